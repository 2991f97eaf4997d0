"""How the server listens: uvicorn's options, with an HTTP protocol that has a read timeout.

uvicorn closes idle keep-alive connections (timeout_keep_alive) and answers 503 past
limit_concurrency, but has no timeout while a request is being read: a connection that sends
nothing, half a header, or a body that stops coming stays open for good, and counts against the
connection limit (slowloris).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import threading
import time
from typing import Any, Iterator

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class ReadTimeoutProtocol(HttpToolsProtocol):
    """Closes a connection whose request header is not complete within `read_timeout` seconds
    of the connection opening (or of the request's first byte, on a kept-alive connection), or
    whose body stops arriving for that long. A pause while uvicorn itself holds reading back
    (the app is behind on the body, or a pipelined request waits) does not count."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            self._arm()
            return
        log.debug("closing a connection from %s: no complete request within %gs", self.client,
                  self.read_timeout)
        self.transport.close()


def uvicorn_options(config) -> dict:
    """uvicorn.run / uvicorn.Config keyword arguments for ServerOptions `config`."""
    # uvicorn counts the connection asking against the limit: +1 serves max_connections of them.
    limit = config.max_connections + 1 if config.max_connections is not None else None
    return {"http": functools.partial(ReadTimeoutProtocol, read_timeout=config.read_timeout),
            "timeout_keep_alive": config.timeout_keep_alive, "limit_concurrency": limit,
            "timeout_graceful_shutdown": 5}


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port that is taken is an error
    in a second, not after the weights are read. OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is ok
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                      + (" (another process uses that port; choose another with --port)"
                         if exc.errno == errno.EADDRINUSE else "")) from None
    return sock


@contextlib.contextmanager
def serve_in_thread(state, host: str = "127.0.0.1", start_timeout: float = 60.0,
                    log_level: str = "warning") -> Iterator[tuple[str, Any]]:
    """Serve the app over ServerState `state` with uvicorn in a daemon thread, on a port the OS
    picks, until the block ends; yields (base URL, the uvicorn.Server). The tests and the load
    test use it."""
    import uvicorn

    from batchrun.server.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=0,
                                           log_level=log_level, **uvicorn_options(state.config)))
    thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)
