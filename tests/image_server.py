"""A loopback HTTP server of images for tests and benchmarks: each path's bytes (404 for any
other path), requests counted per path, an optional sleep per request (all, or some paths).
Image fetching refuses loopback addresses by default: a run fetching from it opts in with
`allow_media_host=[HOST]` (`--allow-media-host 127.0.0.1`)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOST = "127.0.0.1"  # what a run names in allow_media_host to fetch from it


class ImageServer:
    def __init__(self, routes: dict[str, bytes], delay: float = 0.0,
                 slow: dict[str, float] | None = None, redirects: dict[str, str] | None = None):
        """`redirects`: path -> the Location a 302 answer for it names."""
        self.routes, self.delay, self.slow = routes, delay, dict(slow or {})
        self.redirects = dict(redirects or {})
        self.hits: dict[str, int] = {}
        self.host_headers: list[str] = []  # each request's Host header, in order
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                owner.hits[self.path] = owner.hits.get(self.path, 0) + 1
                owner.host_headers.append(self.headers.get("Host", ""))
                time.sleep(owner.slow.get(self.path, owner.delay))
                body = owner.routes.get(self.path)
                if self.path in owner.redirects:
                    self.send_response(302)
                    self.send_header("Location", owner.redirects[self.path])
                    self.end_headers()
                    return
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://{HOST}:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "ImageServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
