"""Image fetches started ahead of the job loop: the lines the loop will read next are read now,
and their image URLs queued on the media fetcher's threads, so the loop (which also steps the
engine) finds the images decoded when it renders those lines."""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import orjson

from batchrun.batch.lines import InputLine, InputReadError


def line_image_urls(text: str | None) -> list[str]:
    """The image URLs a batch line names (chat image_url parts, Responses input_image items);
    whatever cannot be read is left to the line's own validation."""
    if not text or "image" not in text:
        return []
    try:
        body = orjson.loads(text).get("body")
    except (orjson.JSONDecodeError, AttributeError):
        return []
    if not isinstance(body, dict):
        return []
    urls = []
    for key in ("messages", "input"):
        items = body.get(key)
        for item in items if isinstance(items, list) else ():
            content = item.get("content") if isinstance(item, dict) else None
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict):
                    continue
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if isinstance(url, str) and part.get("type") in ("image_url", "input_image"):
                    urls.append(url)
    return urls


def prefetch(lines: Iterator[InputLine], media: Any, lookahead: int) -> Iterator[InputLine]:
    """`lines`, read up to `lookahead` ahead, each line's images queued on `media` as it is read.
    A read error is raised when the loop reaches it, after the lines before it."""
    ahead: deque[InputLine] = deque()
    error: BaseException | None = None
    while True:
        while error is None and len(ahead) < lookahead:
            try:
                item = next(lines)
            except StopIteration:
                error = StopIteration()
                break
            except InputReadError as exc:
                error = exc
                break
            for url in line_image_urls(item.text):
                media.start(url)
            ahead.append(item)
        if ahead:
            yield ahead.popleft()
        elif isinstance(error, StopIteration):
            return
        else:
            raise error
