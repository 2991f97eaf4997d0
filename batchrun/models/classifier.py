"""Sequence-classification checkpoints (`*ForSequenceClassification`): whether a config is one
and its labels, from the config alone (a transformers config or config.json read as plain
attributes or a dict); no torch, so the OpenAI adapters read it from a model folder too."""

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
