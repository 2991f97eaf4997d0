"""The queue of requests waiting for admission.

One level per priority (lowest value first). Within a level, preempted and forked requests go
first, in order. New requests go in arrival order or, with prefix grouping (batch mode), in
lexicographic order of their prompts: requests that share a prefix (system prompt, few-shot
block) are then adjacent and get admitted together while their shared KV blocks are hot.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from batchrun.engine.request import Request

# Prompt tokens that decide the order; longer shared prefixes than this still sort together.
PREFIX_KEY_TOKENS = 4096


class _Level:
    def __init__(self, group_by_prefix: bool):
        self.group_by_prefix = group_by_prefix
        self.front: deque[Request] = deque()
        self.fifo: deque[Request] = deque()
        self.heap: list[tuple[tuple[int, ...], int, Request]] = []
        self.removed: set[int] = set()  # ids of heap entries removed out of order
        self.size = 0

    def push(self, req: Request, seq: int) -> None:
        self.size += 1
        if self.group_by_prefix:
            heapq.heappush(self.heap, (tuple(req.prompt_token_ids[:PREFIX_KEY_TOKENS]), seq, req))
        else:
            self.fifo.append(req)

    def _clean_heap(self) -> None:
        while self.heap and id(self.heap[0][2]) in self.removed:
            self.removed.discard(id(heapq.heappop(self.heap)[2]))

    def peek(self) -> Request | None:
        if self.front:
            return self.front[0]
        if not self.group_by_prefix:
            return self.fifo[0] if self.fifo else None
        self._clean_heap()
        return self.heap[0][2] if self.heap else None

    def pop(self) -> Request:
        self.size -= 1
        if self.front:
            return self.front.popleft()
        if not self.group_by_prefix:
            return self.fifo.popleft()
        self._clean_heap()
        return heapq.heappop(self.heap)[2]

    def remove(self, req: Request) -> bool:
        for q in (self.front, self.fifo):
            if req in q:
                q.remove(req)
                self.size -= 1
                return True
        if any(entry[2] is req for entry in self.heap) and id(req) not in self.removed:
            self.removed.add(id(req))
            self.size -= 1
            return True
        return False


class WaitingQueue:
    def __init__(self, group_by_prefix: bool = False):
        self.group_by_prefix = group_by_prefix
        self.levels: dict[int, _Level] = {}
        self._seq = itertools.count()

    def _level(self, priority: int) -> _Level:
        if priority not in self.levels:
            self.levels[priority] = _Level(self.group_by_prefix)
            self.levels = dict(sorted(self.levels.items()))
        return self.levels[priority]

    def append(self, req: Request) -> None:
        self._level(req.priority).push(req, next(self._seq))

    def appendleft(self, req: Request) -> None:
        level = self._level(req.priority)
        level.front.appendleft(req)
        level.size += 1

    def _first_level(self) -> _Level:
        return next(level for level in self.levels.values() if level.size)

    def peek(self) -> Request:
        req = self._first_level().peek()
        assert req is not None  # the level holds size > 0 requests
        return req

    def popleft(self) -> Request:
        return self._first_level().pop()

    def remove(self, req: Request) -> None:
        level = self.levels.get(req.priority)
        if level is None or not level.remove(req):
            raise ValueError("request is not waiting")

    def __contains__(self, req: Request) -> bool:
        level = self.levels.get(req.priority)
        return level is not None and (req in level.front or req in level.fifo or any(
            e[2] is req for e in level.heap) and id(req) not in level.removed)

    def __len__(self) -> int:
        return sum(level.size for level in self.levels.values())
