"""Sequence-classification checkpoints (`*ForSequenceClassification`): whether a config is one
and its labels, from the config alone (a transformers config or config.json read as plain
attributes or a dict); no torch, so the OpenAI adapters read it from a model folder too.
And a causal LM read as a classifier over a few tokens' logits (--score-tokens: yes/no
rerankers), from its tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def classifier_labels(config: Any) -> list[str] | None:
    """The labels of a *ForSequenceClassification config, in output order (`id2label`, else
    LABEL_i for `num_labels`); None for any other architecture."""
    archs = _get(config, "architectures") or ()
    if not any(str(a).endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for a in archs):
        return None
    id2label = _get(config, "id2label") or {}
    count = len(id2label) or int(_get(config, "num_labels") or 2)
    names = {int(k): str(v) for k, v in id2label.items()}
    return [names.get(i, f"LABEL_{i}") for i in range(count)]


@dataclass(frozen=True)
class ClassifierHead:
    labels: list[str]
    # transformers' *ForSequenceClassification reads the last token that is not this one.
    pad_token_id: int | None = None
    # Not a head but the LM head's logits of these tokens (labels are the tokens).
    token_ids: tuple[int, ...] = ()

    @property
    def scores_pairs(self) -> bool:
        """A cross-encoder: one label, or a token pair scored by the softmax at its second."""
        return len(self.labels) == 1 or len(self.token_ids) == 2

    def pair_logit(self, logits: list[float]) -> float:
        """The one logit a pair's score is the sigmoid of: a token pair's second minus its
        first (the softmax over the two at the second is the sigmoid of that)."""
        return logits[1] - logits[0] if len(self.token_ids) == 2 else logits[0]

    def pooled_prompt(self, ids: list[int]) -> list[int]:
        """The prompt up to the token transformers pools (its last token that is not padding):
        a causal model's state there does not depend on what follows, so dropping the
        trailing pad tokens gives the very logits transformers does."""
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad_token_id:
            end -= 1
        return ids if end == len(ids) else ids[:end]


def folder_head(path: str | Path | None) -> ClassifierHead | None:
    """The classification head the config.json in a model folder describes (None: none there,
    or no head)."""
    if path is None:
        return None
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    labels = classifier_labels(config)
    if labels is None:
        return None
    pad = config.get("pad_token_id")
    return ClassifierHead(labels, pad if isinstance(pad, int) else None)


def token_head(tokenizer, spec: str) -> ClassifierHead:
    """--score-tokens `no,yes`: a head of those vocabulary tokens' logits; ValueError naming a
    token that is not exactly one token of the vocabulary."""
    names = [t.strip() for t in spec.split(",")]
    if not 1 <= len(names) <= 2 or not all(names):
        raise ValueError(f"--score-tokens: one or two comma-separated tokens, got {spec!r}")
    ids = []
    for name in names:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's vocabulary
        found = backend.token_to_id(name) if backend is not None else \
            tokenizer.convert_tokens_to_ids(name)
        if found is None or (found == tokenizer.unk_token_id and name != tokenizer.unk_token):
            encoded = tokenizer.encode(name, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"--score-tokens: {name!r} is not one token of the model's "
                                 f"vocabulary (it encodes as {len(encoded)} tokens)")
            found = encoded[0]
        ids.append(int(found))
    return ClassifierHead(names, None, tuple(ids))
