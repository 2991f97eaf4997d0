"""Tiny random-weight *ForSequenceClassification checkpoints (native and transformers-backend
architectures) with the bundled model's tokenizer, so that text requests run on them."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.tiny_models import ARCHS, BACKEND_ARCHS, make_tiny

BUNDLED_VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _classifier(arch: str, table: dict) -> tuple:
    config, causal, extra = table[arch]
    return config, causal.replace("ForCausalLM", "ForSequenceClassification"), extra


CLASSIFIER_ARCHS = {name: _classifier(name, ARCHS) for name in ("llama", "qwen2", "qwen3")}
CLASSIFIER_ARCHS.update({name: _classifier(name, BACKEND_ARCHS) for name in ("gemma", "gpt_neox")})
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_tiny_classifier(arch: str, path: Path, num_labels: int = 3, seed: int = 0, causal=False):
    """A tiny checkpoint in `path` with the bundled tokenizer: a sequence classifier of
    `num_labels` labels (LABELS for 3; 1 is a cross-encoder), or with causal=True the causal LM
    of the same architecture (an embedding model for score/rerank); returns the transformers
    model (float32, eval)."""
    from batchrun.models.weights.resolve import resolve_model

    table = (ARCHS if arch in ARCHS else BACKEND_ARCHS) if causal else CLASSIFIER_ARCHS
    labels = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}} \
        if num_labels == 3 and not causal else {"num_labels": num_labels}
    model = make_tiny(arch, path, seed, archs=table, vocab_size=BUNDLED_VOCAB, hidden_size=64,
                      intermediate_size=128, **labels)
    source = resolve_model(None).path
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return model
