"""Structured decoding with llguidance: one grammar matcher per sequence, one token bitmask per step.

The matcher of a sequence is created the first time it samples and advanced with every token it
accepts, so preemption and recomputation leave it untouched (the tokens it saw stay the
sequence's output). Masks of all constrained rows are computed in parallel by llguidance's
executor into one int32 bitmask, unpacked on the logits' device with tensor ops.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

from batchrun.engine.sampling_params import GrammarSpec

# JSON is emitted in the canonical `json.dumps` style: a small model given free whitespace can
# spend its whole token budget on newlines inside an object.
if TYPE_CHECKING:  # torch is imported where masks are built: parsing batch lines needs none
    import torch
    from llguidance import LLExecutor, LLTokenizer
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": "}

_tokenizers: dict[tuple[int, tuple[int, ...]], Any] = {}


class Row(Protocol):
    request_id: str
    params: Any


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (not yet checked)."""
    from llguidance import LLMatcher

    if spec.json_schema is not None:
        schema = spec.json_schema
        if isinstance(schema, str):
            schema = json.loads(schema)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.lark is not None:
        return LLMatcher.grammar_from_lark(spec.lark)
    assert spec.regex is not None  # a GrammarSpec holds one of the three
    return LLMatcher.grammar_from_regex(spec.regex)


def validate(spec: GrammarSpec) -> str | None:
    """An error message if the grammar cannot be compiled, else None."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_text(spec))
    except (ValueError, TypeError) as exc:
        return str(exc)
    return error or None


def ll_tokenizer(tokenizer: Any, eos_token_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's view of a tokenizer with a `tokenizers` backend (batchrun's own or a
    transformers fast tokenizer; about 0.3 s to build, so cached). Built from the backend's
    JSON as llguidance.hf.from_tokenizer does, without importing transformers."""
    from copy import copy

    from llguidance import LLTokenizer

    eos = tuple(sorted(eos_token_ids))
    key = (id(tokenizer), eos)
    if key not in _tokenizers:
        backend = copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        _tokenizers[key] = (tokenizer, LLTokenizer(
            backend.to_str(), eos_token=list(eos) or tokenizer.eos_token_id))
    return _tokenizers[key][1]


class GrammarMatchers:
    """The matchers of the sequences that sample under a grammar."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._matchers: dict[str, Any] = {}

    def _matcher(self, row: Row):
        m = self._matchers.get(row.request_id)
        if m is None:
            import llguidance

            m = llguidance.LLMatcher(self._runtime()[0], grammar_text(row.params.grammar),
                                     log_level=0)
            self._matchers[row.request_id] = m
        return m

    def _runtime(self) -> tuple[LLTokenizer, LLExecutor]:
        """llguidance's tokenizer and executor, made on first use."""
        if self._ll is None or self._executor is None:
            import llguidance

            self._ll = ll_tokenizer(self.tokenizer, self.eos_token_ids)
            self._executor = llguidance.LLExecutor()
        return self._ll, self._executor

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def allowed(self, rows: Sequence[Row], vocab_size: int,
                device: torch.device) -> tuple[list[int], torch.Tensor] | None:
        """(indices of constrained rows, bool [M, vocab_size] of the tokens each may take)."""
        import torch

        idx = [i for i, r in enumerate(rows) if r.params.grammar is not None]
        if not idx:
            return None
        matchers = [self._matcher(rows[i]) for i in idx]
        ll, executor = self._runtime()
        words = (ll.vocab_size + 31) // 32
        bitmask = torch.zeros((len(idx), words), dtype=torch.int32)
        # llguidance's pointer API (the one pointer outside engine/kernels/ops.py: the engine's
        # kernels are not llguidance's, and llguidance.torch, which wraps this call, imports
        # 118 MiB of modules)
        executor.unsafe_compute_mask_ptr(
            [(m, j) for j, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(idx))
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = (bitmask.to(device)[:, :, None] >> shifts) & 1
        allowed = bits.reshape(len(idx), words * 32)[:, :vocab_size].bool()
        if allowed.shape[1] < vocab_size:  # the model's vocabulary is padded past the tokenizer's
            pad = allowed.new_zeros((len(idx), vocab_size - allowed.shape[1]))
            allowed = torch.cat([allowed, pad], dim=1)
        # A matcher in an error state allows nothing: let it end the sequence instead.
        dead = ~allowed.any(dim=1)
        if bool(dead.any()) and self.eos_token_ids:
            eos = torch.tensor([e for e in self.eos_token_ids if e < vocab_size], device=device)
            allowed[dead.nonzero()[:, 0][:, None], eos[None, :]] = True
        return idx, allowed

    def accept(self, rows: Sequence[Row], tokens: Sequence[int]) -> None:
        for row, token in zip(rows, tokens):
            if row.params.grammar is not None:
                self._matcher(row).consume_token(token)
