"""Images of requests: fetched and decoded on worker threads ahead of the engine, each URL once.

Sources: `data:` URLs (base64), http(s)://, any other fsspec URL (s3://, gs://, ...) through the
opener the caller gives (the job's storage options), and local files (a path or file:// URL) only
under --allowed-media-path. Transient errors (connection, timeout, HTTP 429/5xx) are retried with
backoff; a bad image is a MediaError the caller turns into that request's error.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Callable

from batchrun.options.openai import OpenAIOptions

# What PIL decodes that models are shown; anything else (e.g. PSD, EPS) is refused.
FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"}
_CACHE_BYTES = 256 << 20  # decoded images kept for lines that reuse them


class MediaError(ValueError):
    """An image a request names cannot be used; `code` is the error record's code."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code


class _Transient(Exception):
    """A fetch failure worth retrying."""


def is_local(url: str) -> bool:
    return url.startswith("file://") or "://" not in url and not url.startswith("data:")


def check_source(url: str, options: OpenAIOptions) -> None:
    """What can be known without fetching: the URL's kind, a data: URL's encoding, a local path
    inside the allowed directory; MediaError otherwise."""
    if not isinstance(url, str) or not url:
        raise MediaError("the image URL must be a non-empty string", "invalid_value")
    if url.startswith("data:"):
        _decode_data_url(url, options.media_max_bytes)
    elif is_local(url):
        _local_path(url, options.allowed_media_path)


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data: URL must be data:<type>;base64,<payload>", "invalid_value")
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaError(f"the image has more than {max_bytes} bytes (--media-max-bytes)",
                         "image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL is not valid base64: {exc}", "invalid_value") from None


def _local_path(url: str, allowed: str | None) -> Path:
    if allowed is None:
        raise MediaError("local image files are not allowed (run with --allowed-media-path DIR)",
                         "media_path_not_allowed")
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(allowed))
    if not real.is_relative_to(root):
        raise MediaError(f"{url} is outside the allowed media directory", "media_path_not_allowed")
    return real


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
    if image.format not in FORMATS:
        raise MediaError(f"image format {image.format} is not supported "
                         f"({', '.join(sorted(FORMATS))})", "unsupported_image_format")
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} pixels, more than "
                         f"{max_pixels} (--media-max-pixels)", "image_too_large")
    try:
        image.load()
    except Exception as exc:  # truncated or corrupt data: PIL raises many kinds
        raise MediaError(f"the image could not be decoded: {exc}") from None
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image


class MediaFetcher:
    """Fetches and decodes images on a thread pool; `start(url)` queues one (each URL once while
    its image is cached), `image(url)` waits for it."""

    def __init__(self, options: OpenAIOptions,
                 open_url: Callable[[str], IO[bytes]] | None = None):
        """`open_url(url)`: a binary stream for an fsspec URL (s3://, gs://, ...), with the job's
        storage options; None: such URLs are refused."""
        self.options = options
        self.open_url = open_url
        self.pool = ThreadPoolExecutor(options.media_fetch_workers,
                                       thread_name_prefix="batchrun-media")
        self.lock = threading.Lock()
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self.cached_bytes = 0

    def start(self, url: str) -> Future:
        with self.lock:
            future = self.futures.get(url)
            if future is not None:
                self.futures.move_to_end(url)
                return future
            future = self.pool.submit(self._load, url)
            self.futures[url] = future
        # Outside the lock: a future already done runs the callback here, and it takes the lock.
        future.add_done_callback(self._account)
        return future

    def image(self, url: str):
        """The decoded image (MediaError for a bad one)."""
        return self.start(url).result()

    def _account(self, future: Future) -> None:
        if future.exception() is not None:  # kept too: lines naming it get the same error
            return
        image = future.result()
        with self.lock:
            self.cached_bytes += len(image.getbands()) * image.width * image.height
            while self.cached_bytes > _CACHE_BYTES and len(self.futures) > 1:
                _, old = self.futures.popitem(last=False)
                if old.done() and old.exception() is None:
                    img = old.result()
                    self.cached_bytes -= len(img.getbands()) * img.width * img.height

    def _load(self, url: str):
        return decode(self._bytes(url), self.options.media_max_pixels)

    def _bytes(self, url: str) -> bytes:
        opts = self.options
        check_source(url, opts)
        if url.startswith("data:"):
            return _decode_data_url(url, opts.media_max_bytes)
        if is_local(url):
            with open(_local_path(url, opts.allowed_media_path), "rb") as f:
                return self._read_limited(f)
        for attempt in range(opts.media_fetch_retries + 1):
            try:
                return self._fetch_remote(url)
            except _Transient as exc:
                if attempt == opts.media_fetch_retries:
                    raise MediaError(f"fetching the image failed after {attempt + 1} attempts: "
                                     f"{exc}", "image_fetch_failed") from None
                time.sleep(min(0.2 * 2 ** attempt, 2.0))
        raise AssertionError("unreachable")

    def _fetch_remote(self, url: str) -> bytes:
        if url.startswith(("http://", "https://")):
            request = urllib.request.Request(url, headers={"User-Agent": "batchrun"})
            try:
                with urllib.request.urlopen(request, timeout=self.options.media_fetch_timeout) as r:
                    return self._read_limited(r)
            except urllib.error.HTTPError as exc:
                if exc.code == 429 or exc.code >= 500:
                    raise _Transient(f"HTTP {exc.code}") from None
                raise MediaError(f"fetching the image failed: HTTP {exc.code} {exc.reason}",
                                 "image_fetch_failed") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                raise _Transient(str(getattr(exc, "reason", exc))) from None
        if self.open_url is None:
            raise MediaError(f"image URLs like {url.split('://')[0]}:// are not supported here",
                             "invalid_value")
        try:
            with self.open_url(url) as f:
                return self._read_limited(f)
        except FileNotFoundError:
            raise MediaError("fetching the image failed: no such object",
                             "image_fetch_failed") from None
        except (TimeoutError, ConnectionError) as exc:
            raise _Transient(str(exc)) from None
        except Exception as exc:  # the filesystem's own errors (credentials, endpoint, ...)
            raise MediaError(f"fetching the image failed: {type(exc).__name__}: {exc}",
                             "image_fetch_failed") from None

    def _read_limited(self, stream: Any) -> bytes:
        limit = self.options.media_max_bytes
        data = stream.read(limit + 1)
        if len(data) > limit:
            raise MediaError(f"the image has more than {limit} bytes (--media-max-bytes)",
                             "image_too_large")
        return data

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
