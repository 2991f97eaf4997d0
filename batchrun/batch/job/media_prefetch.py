"""Image fetches started ahead of the job loop: the lines the loop will read next are read now,
and their image URLs queued on the media fetcher's threads, so the loop (which also steps the
engine) finds the images decoded when it renders those lines. It takes the first line of the
read-ahead window whose images are all there, so a slow host holds back only the lines that
name it (the output keeps input order: records carry their positions; a line never passes an
earlier one with the same custom_id, so the first of two duplicates is the one that runs), and
it never blocks on a fetch: with nothing else to run it waits in short slices, checking its
deadline between."""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, Iterator

import orjson

from batchrun.batch.storage.lines import InputLine, InputReadError


def line_refs(text: str | None) -> tuple[str | None, list[str]]:
    """The custom_id and the image URLs a batch line names (chat image_url parts, Responses
    input_image items); whatever cannot be read is left to the line's own validation."""
    if not text:
        return None, []
    try:
        line = orjson.loads(text)
        body = line.get("body")
    except (orjson.JSONDecodeError, AttributeError):
        return None, []
    custom_id = line.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    if not isinstance(body, dict) or "image" not in text:
        return custom_id, []
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
    return custom_id, urls


class Prefetch:
    """`lines`, read up to `lookahead` ahead, each line's images queued on `media` as it is
    read. `ready()` says whether some line's images are all decoded (or failed), and next()
    gives the first such line (the window's first line when none is); `wait(seconds)` waits
    for one. A read error is raised when the loop reaches it, after the lines before it."""

    def __init__(self, lines: Iterator[InputLine], media: Any, lookahead: int):
        self.lines, self.media, self.lookahead = lines, media, lookahead
        self.ahead: deque[tuple[InputLine, list, str | None]] = deque()  # line, futures, id
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
                custom_id, urls = line_refs(item.text)
                self.ahead.append((item, [self.media.start(url) for url in urls], custom_id))

    def _first_ready(self) -> int | None:
        """The first line whose images are there and that passes no earlier line with its
        custom_id (the first of two duplicates stays the one that runs)."""
        before: set[str | None] = set()
        for i, (_, futures, custom_id) in enumerate(self.ahead):
            if all(f.done() for f in futures) and (custom_id is None or custom_id not in before):
                return i
            before.add(custom_id)
        return None

    def ready(self) -> bool:
        self._fill()
        return not self.ahead or self._first_ready() is not None

    def wait(self, seconds: float) -> None:
        """Until a line's images are all there, for at most `seconds`."""
        pending = {f for _, futures, _ in self.ahead for f in futures if not f.done()}
        if pending and seconds > 0:
            wait(pending, timeout=seconds, return_when=FIRST_COMPLETED)

    def __next__(self) -> InputLine:
        self._fill()
        if self.ahead:
            index = self._first_ready() or 0
            item = self.ahead[index][0]
            del self.ahead[index]
            return item
        if isinstance(self.end, InputReadError):
            end, self.end = self.end, StopIteration()
            raise end
        raise StopIteration
