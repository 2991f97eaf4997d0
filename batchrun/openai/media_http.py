"""One image fetched over http(s) from an address that was checked (media_hosts.HostPolicy):
urllib3 connects to that address while the request keeps the URL's Host header and TLS keeps
its server name (SNI and certificate check), so DNS is asked once per hop; redirects are
followed here, each hop's host checked again. Every way a connection can fail (refused,
reset, timed out, not HTTP, TLS) reads the same, so answers do not tell which ports are open.
"""

from __future__ import annotations

import time
from urllib.parse import urljoin, urlsplit

import urllib3

from batchrun.openai.media_errors import MediaError, too_many_bytes
from batchrun.openai.media_hosts import HostPolicy

MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
UNREACHABLE = "the host could not be reached or did not answer over HTTP"


class Transient(Exception):
    """A fetch failure worth retrying."""


def split_http_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path with query) of an http(s) URL; MediaError when malformed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(f"the image URL is malformed: {exc}", "invalid_value") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("the image URL must be http(s)://HOST/...", "invalid_value")
    default = 443 if parts.scheme == "https" else 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or default, path


def _host_header(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == (443 if scheme == "https" else 80) else f"{shown}:{port}"


def fetch(url: str, policy: HostPolicy, timeout: float, max_bytes: int) -> bytes:
    """The body at `url` (at most max_bytes, within `timeout` seconds in all), following up to
    MAX_REDIRECTS redirects. MediaError for a refused host or a final answer that is not 200;
    Transient for what may pass (no connection, 429, 5xx)."""
    until = time.monotonic() + timeout
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port, path = split_http_url(url)
        address = policy.resolve(host, port)
        left = until - time.monotonic()
        if left <= 0:
            raise Transient(UNREACHABLE)
        limits = urllib3.Timeout(connect=left, read=left)
        if scheme == "https":
            pool: urllib3.HTTPConnectionPool = urllib3.HTTPSConnectionPool(
                address, port, timeout=limits, retries=False, maxsize=1,
                server_hostname=host, assert_hostname=host, cert_reqs="CERT_REQUIRED")
        else:
            pool = urllib3.HTTPConnectionPool(address, port, timeout=limits, retries=False,
                                              maxsize=1)
        try:
            response = pool.urlopen("GET", path, redirect=False, preload_content=False,
                                    headers={"Host": _host_header(host, port, scheme),
                                             "User-Agent": "batchrun"})
            try:
                if response.status in _REDIRECTS and response.headers.get("Location"):
                    url = urljoin(url, response.headers["Location"])
                    continue
                if response.status == 429 or response.status >= 500:
                    raise Transient(f"HTTP {response.status}")
                if response.status != 200:
                    raise MediaError(f"fetching the image failed: HTTP {response.status} "
                                     f"{response.reason or ''}".rstrip(), "image_fetch_failed")
                return _read_limited(response, max_bytes, until)
            finally:
                response.release_conn()
        except (urllib3.exceptions.HTTPError, OSError):
            raise Transient(UNREACHABLE) from None
        finally:
            pool.close()
    raise MediaError(f"fetching the image failed: more than {MAX_REDIRECTS} redirects",
                     "image_fetch_failed")


def _read_limited(response: urllib3.BaseHTTPResponse, max_bytes: int, until: float) -> bytes:
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_many_bytes(max_bytes)
    chunks, size = [], 0
    while chunk := response.read(min(1 << 16, max_bytes + 1 - size) or 1):
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise too_many_bytes(max_bytes)
        if time.monotonic() > until:  # a host that drips its answer
            raise Transient(UNREACHABLE)
    return b"".join(chunks)
