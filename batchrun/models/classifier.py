"""Sequence-classification checkpoints (`*ForSequenceClassification`): whether a config is one
and its labels, from the config alone (a transformers config or config.json read as plain
attributes or a dict); no torch, so the OpenAI adapters read it from a model folder too."""

from __future__ import annotations

import json
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


def folder_labels(path: str | Path | None) -> list[str] | None:
    """classifier_labels of the config.json in a model folder (None: none there, or no head)."""
    if path is None:
        return None
    file = Path(path) / "config.json"
    try:
        return classifier_labels(json.loads(file.read_text()))
    except (OSError, ValueError):
        return None
