"""Engine logprobs -> OpenAI's shapes: chat `logprobs.content[]` and completions' token lists.

Token text and bytes come from the token itself, not from decoding it alone: a byte-level BPE
token can be half of a UTF-8 character, whose bytes OpenAI reports exactly and whose text it
spells as `bytes:\\xe2\\x80`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Sequence

from batchrun.engine.outputs import TokenLogprob

FLOOR = -9999.0


def floor(logprob: float) -> float:
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else logprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character stand-ins for bytes, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Cached (text, bytes) of token ids for one tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_level = self._is_byte_level(tokenizer)

    @staticmethod
    def _is_byte_level(tokenizer: Any) -> bool:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(tok, str):
            if token_id in getattr(self.tokenizer, "all_special_ids", ()):
                return tok.encode()
            if self._byte_level:
                table = _byte_decoder()
                if all(ch in table for ch in tok):
                    return bytes(table[ch] for ch in tok)
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                return bytes([int(tok[3:5], 16)])  # sentencepiece byte fallback
            if tok.startswith("▁"):
                tok = " " + tok[1:]
            return tok.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenText,
                  top_n: int) -> dict[str, Any]:
    content = []
    for e in entries:
        token, raw = texts.get(e.token_id)
        top = []
        for tid, lp in e.top[:top_n]:
            t, b = texts.get(tid)
            top.append({"token": t, "logprob": floor(lp), "bytes": b})
        content.append({"token": token, "logprob": floor(e.logprob), "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenText,
                        start_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = start_offset
    for e in entries:
        token, _ = texts.get(e.token_id)
        tokens.append(token)
        token_logprobs.append(floor(e.logprob))
        top: dict[str, float] = {}
        for tid, lp in e.top:
            top.setdefault(texts.get(tid)[0], floor(lp))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
