"""Incremental, UTF-8-safe detokenization with stop strings.

Each new token is decoded together with a few tokens before it (so tokenizers that drop a
leading space on a lone token still join words correctly); text is only emitted once it no
longer ends in an incomplete UTF-8 sequence (U+FFFD). Stop strings are searched across token
boundaries and are not part of the returned text.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Feed one generated token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        hits = [(idx, stop) for stop in self.stop if (idx := self.text.find(stop, start)) >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        self.text = self.text[:idx]
        return stop

    def flush(self) -> str:
        """Text including a trailing incomplete sequence, for a request that ends mid-character."""
        tail = self._decode(self.ids[self.read_offset:]) if self.read_offset < len(self.ids) else ""
        return self.text + tail

    def stable_text(self) -> str:
        """Text safe to stream: holds back a suffix that could still grow into a stop string."""
        if not self.stop:
            return self.text
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return self.text[:len(self.text) - hold]
