"""Which addresses an image URL may be fetched from.

By default only public addresses: the host name is resolved here and every address it resolves
to must be global unicast, so loopback, private (RFC 1918, unique local), link-local (a cloud
metadata endpoint), shared, multicast, reserved and unspecified addresses are refused in every
spelling the resolver accepts (`http://2130706433/`, `0177.0.0.1`, `[::ffff:127.0.0.1]`,
6to4 or NAT64 forms of a private IPv4). The fetch then connects to the address that was
checked, so a DNS answer cannot change between the check and the connection.

`--allow-media-host HOST|CIDR` (repeatable) lets the operator name hosts (by the URL's host
name, any address) or networks (by the resolved address) that are fetched from anyway.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable

from batchrun.openai.media_errors import MediaError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
REFUSED_HINT = "it is not a public address (an operator may allow it with --allow-media-host)"


def _embedded_ipv4(ip: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, Teredo client, NAT64)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _global(ip: Address) -> bool:
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback
                                 or ip.is_link_local or ip.is_unspecified or ip.is_private)


def is_public(ip: Address) -> bool:
    """Whether connecting to `ip` reaches a public host (both parts of a v6 form of a v4)."""
    inner = _embedded_ipv4(ip)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _global(ip.ipv4_mapped)  # ::ffff:a.b.c.d is a.b.c.d on the wire
    return _global(ip) and (inner is None or _global(inner))


class HostPolicy:
    """The operator's --allow-media-host entries, and the check of a URL's host against them."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allowed:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))

    def _allowed(self, ip: Address) -> bool:
        inner = _embedded_ipv4(ip)
        return is_public(ip) or any(ip in n or inner is not None and inner in n
                                    for n in self.networks)

    def check_literal(self, host: str) -> None:
        """Refuse a host written as a numeric address that is not allowed, without DNS."""
        ip = numeric_address(host)
        if ip is not None and host.lower().rstrip(".") not in self.names and \
                not self._allowed(ip):
            raise MediaError(f"the image host {host} is refused: {REFUSED_HINT}",
                             "media_host_not_allowed")

    def resolve(self, host: str, port: int) -> str:
        """The address to connect to for `host`: resolved once, every answer checked (one
        refused answer refuses the host, so a mixed answer cannot be used to reach inside)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, ValueError):
            raise MediaError(f"fetching the image failed: the host name {host} does not resolve",
                             "image_fetch_failed") from None
        addresses = [_address(info[4][0]) for info in infos]
        if host.lower().rstrip(".") not in self.names:
            if not addresses or not all(self._allowed(ip) for ip in addresses):
                raise MediaError(f"the image host {host} is refused: {REFUSED_HINT}",
                                 "media_host_not_allowed")
        return str(addresses[0])


def numeric_address(host: str) -> Address | None:
    """`host` as an address when it is one in any spelling the resolver takes (dotted, decimal,
    octal, hex, IPv6), without a DNS query; None for a name."""
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return _address(infos[0][4][0]) if infos else None


def _address(text: str | int) -> Address:
    """A resolver answer's address, without an IPv6 zone (`fe80::1%eth0`)."""
    return ipaddress.ip_address(str(text).split("%", 1)[0])
