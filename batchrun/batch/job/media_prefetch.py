"""Image fetches started ahead of the job loop: the lines the loop will read next are read now,
and their image URLs queued on the media fetcher's threads, so the loop (which also steps the
engine) finds the images decoded when it renders those lines, and admits no line whose images
are still on their way while the engine has other work."""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import orjson

from batchrun.batch.storage.lines import InputLine, InputReadError


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


class Prefetch:
    """`lines`, read up to `lookahead` ahead, each line's images queued on `media` as it is
    read. `ready()` says whether the next line's images are all decoded (or failed), so the job
    loop can step the engine instead of waiting on the network. A read error is raised when the
    loop reaches it, after the lines before it."""

    def __init__(self, lines: Iterator[InputLine], media: Any, lookahead: int):
        self.lines, self.media, self.lookahead = lines, media, lookahead
        self.ahead: deque[tuple[InputLine, list]] = deque()
        self.end: BaseException | None = None  # StopIteration or the InputReadError

    def __iter__(self) -> "Prefetch":
        return self

    def _fill(self) -> None:
        while self.end is None and len(self.ahead) < self.lookahead:
            try:
                item = next(self.lines)
            except StopIteration as exc:
                self.end = exc
            except InputReadError as exc:
                self.end = exc
            else:
                futures = [self.media.start(url) for url in line_image_urls(item.text)]
                self.ahead.append((item, futures))

    def ready(self) -> bool:
        self._fill()
        return not self.ahead or all(f.done() for f in self.ahead[0][1])

    def __next__(self) -> InputLine:
        self._fill()
        if self.ahead:
            return self.ahead.popleft()[0]
        if isinstance(self.end, InputReadError):
            end, self.end = self.end, StopIteration()
            raise end
        raise StopIteration
