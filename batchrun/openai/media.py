"""Images of requests: fetched and decoded on worker threads ahead of the engine, each URL once.

Sources: `data:` URLs (base64), http(s):// from public addresses only unless allowed
(media_hosts.py, fetched by media_http.py), an object store URL (s3://, gs://, ...) through the
opener the caller gives (the job's storage options), and local files (a path or file:// URL) only
under --allowed-media-path. Transient errors (connection, timeout, HTTP 429/5xx) are retried with
backoff, never past the fetcher's deadline; a bad image is a MediaError the caller turns into
that request's error. A failure is remembered for FAILURE_TTL seconds only, so a host that
recovers is fetched from again.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Callable
from urllib.parse import unquote

from batchrun.openai import media_http
from batchrun.openai.media_errors import MediaError, too_many_bytes
from batchrun.openai.media_hosts import HostPolicy
from batchrun.openai.media_http import Transient
from batchrun.options.openai import OpenAIOptions

# What PIL decodes that models are shown; anything else (e.g. PSD, EPS) is refused.
FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"}
_CACHE_BYTES = 256 << 20  # decoded images kept for lines that reuse them
FAILURE_TTL = 10.0  # seconds a failed fetch answers for its URL before it is tried again
# Object stores reached through the caller's opener (its storage options); other fsspec
# protocols (ftp, sftp, smb, ...) would reach any host, so they are refused.
STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2")

__all__ = ["MediaError", "MediaFetcher", "check_source", "decode", "is_local"]


def is_local(url: str) -> bool:
    return url.startswith("file://") or "://" not in url and not url.startswith("data:")


def check_source(url: str, options: OpenAIOptions) -> None:
    """What can be known without fetching: the URL's kind, a data: URL's encoding, a local path
    inside the allowed directory, an http(s) host written as an address that is refused;
    MediaError otherwise."""
    if not isinstance(url, str) or not url:
        raise MediaError("the image URL must be a non-empty string", "invalid_value")
    if url.startswith("data:"):
        _decode_data_url(url, options.media_max_bytes)
    elif is_local(url):
        _local_path(url, options.allowed_media_path)
    elif _is_http(url):
        _, host, _, _ = media_http.split_http_url(url)
        HostPolicy(options.allow_media_host).check_literal(host)
    elif url.split("://", 1)[0].lower() not in STORE_PROTOCOLS:
        raise MediaError(f"image URLs like {url.split('://', 1)[0]}:// are not supported "
                         f"(http(s), data:, {', '.join(STORE_PROTOCOLS)} or a local file)",
                         "invalid_value")


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data: URL must be data:<type>;base64,<payload>", "invalid_value")
    if len(payload) * 3 // 4 > max_bytes:
        raise too_many_bytes(max_bytes)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL is not valid base64: {exc}", "invalid_value") from None


def _local_path(url: str, allowed: str | None) -> Path:
    if allowed is None:
        raise MediaError("local image files are not allowed (run with --allowed-media-path DIR)",
                         "media_path_not_allowed")
    # A file:// URL is percent-encoded (RFC 8089): %2e%2e is `..`, decoded before the check.
    path = Path(unquote(url[len("file://"):]) if url.startswith("file://") else url)
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(allowed))
    if not real.is_relative_to(root):
        raise MediaError(f"{url} is outside the allowed media directory", "media_path_not_allowed")
    return real


def _read_local(url: str, allowed: str | None, max_bytes: int) -> bytes:
    """A local image file's bytes: a regular file under the allowed directory (a folder, a
    device or a FIFO is refused before it is read; opened without blocking)."""
    path = _local_path(url, allowed)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MediaError(f"{url}: no such file", "image_fetch_failed") from None
    except OSError as exc:
        raise MediaError(f"{url} cannot be read: {exc.strerror}", "image_fetch_failed") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MediaError(f"{url} is not a regular file", "invalid_value")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise too_many_bytes(max_bytes)
    return data


def decode(data: bytes, max_pixels: int):
    """The RGB image in `data`; MediaError for what is not a whole image of a known format or is
    too large once decoded (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MediaError("the data is not an image of a known format") from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"the image is too large: {exc}", "image_too_large") from None
    except Exception as exc:  # a header cut short or corrupt: PIL raises many kinds (OSError)
        raise MediaError(f"the image could not be decoded: {exc}") from None
    if image.format not in FORMATS:
        raise MediaError(f"image format {image.format} is not supported "
                         f"({', '.join(sorted(FORMATS))})", "unsupported_image_format")
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} pixels, more than "
                         f"{max_pixels} (--media-max-pixels)", "image_too_large")
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as exc:  # truncated or corrupt data: PIL raises many kinds
        raise MediaError(f"the image could not be decoded: {exc}") from None


class MediaFetcher:
    """Fetches and decodes images on a thread pool; `start(url)` queues one (each URL once while
    its image is cached; a failure for FAILURE_TTL seconds), `image(url)` waits for it.
    `deadline` (a Unix time, the job's --deadline) bounds every fetch and its retries."""

    def __init__(self, options: OpenAIOptions,
                 open_url: Callable[[str], IO[bytes]] | None = None):
        """`open_url(url)`: a binary stream for an object store URL (s3://, gs://, ...), with
        the job's storage options; None: such URLs are refused."""
        self.options = options
        self.open_url = open_url
        self.hosts = HostPolicy(options.allow_media_host)
        self.deadline: float | None = None
        self.pool = ThreadPoolExecutor(options.media_fetch_workers,
                                       thread_name_prefix="batchrun-media")
        self.lock = threading.Lock()
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self.failed_at: dict[str, float] = {}  # url -> time.monotonic() of its failure
        self.cached_bytes = 0

    def start(self, url: str) -> Future:
        with self.lock:
            future = self.futures.get(url)
            if future is not None and not self._expired_failure(url, future):
                self.futures.move_to_end(url)
                return future
            self.failed_at.pop(url, None)
            future = self.pool.submit(self._load, url)
            self.futures[url] = future
        # Outside the lock: a future already done runs the callback here, and it takes the lock.
        future.add_done_callback(lambda done: self._account(url, done))
        return future

    def _expired_failure(self, url: str, future: Future) -> bool:
        failed = self.failed_at.get(url)
        return failed is not None and time.monotonic() - failed > FAILURE_TTL

    def image(self, url: str):
        """The decoded image (MediaError for a bad one)."""
        return self.start(url).result()

    def _account(self, url: str, future: Future) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:  # answers lines naming it for FAILURE_TTL seconds
            with self.lock:
                if self.futures.get(url) is future:
                    self.failed_at[url] = time.monotonic()
            return
        image = future.result()
        with self.lock:
            self.cached_bytes += len(image.getbands()) * image.width * image.height
            while self.cached_bytes > _CACHE_BYTES and len(self.futures) > 1:
                old_url, old = self.futures.popitem(last=False)
                self.failed_at.pop(old_url, None)
                if old.done() and not old.cancelled() and old.exception() is None:
                    img = old.result()
                    self.cached_bytes -= len(img.getbands()) * img.width * img.height

    def _load(self, url: str):
        return decode(self._bytes(url), self.options.media_max_pixels)

    def _time_left(self) -> float:
        """Seconds one attempt may take: the fetch timeout, less near the deadline."""
        left = self.options.media_fetch_timeout
        if self.deadline is not None:
            left = min(left, self.deadline - time.time())
        if left <= 0:
            raise MediaError("fetching the image failed: the batch's deadline passed",
                             "image_fetch_failed")
        return left

    def _bytes(self, url: str) -> bytes:
        opts = self.options
        check_source(url, opts)
        if url.startswith("data:"):
            return _decode_data_url(url, opts.media_max_bytes)
        if is_local(url):
            return _read_local(url, opts.allowed_media_path, opts.media_max_bytes)
        for attempt in range(opts.media_fetch_retries + 1):
            try:
                return self._fetch_remote(url, self._time_left())
            except Transient as exc:
                if attempt == opts.media_fetch_retries:
                    raise MediaError(f"fetching the image failed after {attempt + 1} attempts: "
                                     f"{exc}", "image_fetch_failed") from None
                time.sleep(min(0.2 * 2 ** attempt, 2.0, max(0.0, self._time_left())))
        raise AssertionError("unreachable")

    def _fetch_remote(self, url: str, timeout: float) -> bytes:
        if _is_http(url):
            return media_http.fetch(url, self.hosts, timeout, self.options.media_max_bytes)
        if self.open_url is None:
            raise MediaError(f"image URLs like {url.split('://')[0]}:// are not supported here",
                             "invalid_value")
        try:
            with self.open_url(url) as f:
                data = f.read(self.options.media_max_bytes + 1)
        except FileNotFoundError:
            raise MediaError("fetching the image failed: no such object",
                             "image_fetch_failed") from None
        except (TimeoutError, ConnectionError) as exc:
            raise Transient(str(exc)) from None
        except Exception as exc:  # the filesystem's own errors (credentials, endpoint, ...)
            raise MediaError(f"fetching the image failed: {type(exc).__name__}: {exc}",
                             "image_fetch_failed") from None
        if len(data) > self.options.media_max_bytes:
            raise too_many_bytes(self.options.media_max_bytes)
        return data

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
