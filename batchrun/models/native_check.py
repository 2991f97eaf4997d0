"""The load check (load_check.py) of a native model against transformers' forward of its
checkpoint, bounded to the first layers: the first `checked_layers` (at least two, and enough
for one layer of each kind: full and windowed, say) run on both sides, then the final norm
and the head. The reference is built in float32 from those layers' weights alone (the embedding,
the layers, the head: memory bounded whatever the model's depth) once per checkpoint and
cached, so a later load of the same files runs only the native side (a few milliseconds) and
imports no transformers.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import cast

import torch
from torch import nn

from batchrun.models import load_check

log = logging.getLogger("batchrun")
VERSION = 1  # of the reference's prompt and layout: a change computes them again


def checked_layers(windows, num_layers: int) -> int:
    """The first layers the check runs: two, or up to the first layer of each kind."""
    kinds: dict = {}
    for i, window in enumerate(windows or ()):
        kinds.setdefault(window, i)
    return min(num_layers, max([2, *(i + 1 for i in kinds.values())]))


@contextlib.contextmanager
def first_layers(model: nn.Module, n: int):
    """`model` running its first n decoder layers only (then its final norm and head)."""
    layers = model.layers
    model.layers = nn.ModuleList(list(cast(nn.ModuleList, layers))[:n])
    try:
        yield
    finally:
        model.layers = layers


def truncated_config(path: Path, n: int, trust_remote_code: bool):
    from transformers import AutoConfig

    from batchrun.models.weights.remote_code import auto_kwargs

    hf = AutoConfig.from_pretrained(path, **auto_kwargs(trust_remote_code))
    hf.num_hidden_layers = n
    if getattr(hf, "layer_types", None):
        hf.layer_types = list(hf.layer_types)[:n]
    return hf


@torch.inference_mode()
def reference_logits(path: Path, n: int, ids: torch.Tensor, num_labels: int,
                     trust_remote_code: bool = False) -> torch.Tensor:
    """transformers' float32 logits of `ids` on the checkpoint's first n layers (a classifier:
    its pooled scores)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from batchrun.models.weights.remote_code import auto_kwargs

    auto = AutoModelForSequenceClassification if num_labels else AutoModelForCausalLM
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the layers left out are "unused weights"
    try:
        hf = auto.from_pretrained(path, config=truncated_config(path, n, trust_remote_code),
                                  dtype=torch.float32, attn_implementation="eager",
                                  **auto_kwargs(trust_remote_code))
    finally:
        transformers.logging.set_verbosity(verbosity)
    logits = hf.eval()(input_ids=ids[None], use_cache=False).logits
    return (logits if num_labels else logits[0]).float()


def cache_path(files: list[Path], n: int, num_labels: int) -> Path:
    from importlib.metadata import version

    from batchrun.models.quant.calibration import weights_identity
    from batchrun.paths import cache_dir

    key = hashlib.sha256(f"{VERSION}:{load_check.SEED}:{load_check.CHUNKS}:{n}:{num_labels}:"
                         f"{version('transformers')}:{weights_identity(files)}".encode())
    return cache_dir() / "load-check" / f"{key.hexdigest()[:32]}.pt"


def cached_reference(path: Path, files: list[Path], n: int, ids: torch.Tensor, num_labels: int,
                     trust_remote_code: bool) -> torch.Tensor:
    """reference_logits, from the cache when an earlier load computed them."""
    cache = cache_path(files, n, num_labels)
    if cache.is_file():
        try:
            cached = torch.load(cache, weights_only=True)
            if cached["ids"].equal(ids):
                return cached["logits"]
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            log.warning("ignoring the unreadable load-check cache %s: %s", cache, exc)
    logits = reference_logits(path, n, ids, num_labels, trust_remote_code)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits}, cache)
    return logits


class NoReference(Exception):
    """transformers could not build or run the checkpoint's first layers."""


def check(model, path: Path, files: list[Path], device: torch.device, dtype: torch.dtype,
          trust_remote_code: bool = False) -> load_check.Verdict | None:
    """load_check.verify of the native `model` (its first checked_layers) against transformers'
    forward of the same checkpoint's first layers; None, with a warning, where transformers
    cannot build that reference (no evidence either way: the model loads)."""
    cfg = model.config
    n = checked_layers(getattr(cfg, "windows", None), len(model.layers))

    def reference(ids):
        try:
            return cached_reference(path, files, n, ids, model.num_labels, trust_remote_code)
        except Exception as exc:  # transformers' own refusal of the truncated checkpoint
            raise NoReference(f"{type(exc).__name__}: {exc}") from exc

    with first_layers(model, n):
        try:
            return load_check.verify(model, reference,
                                     f"{path} (its first {n} layers on the native path)",
                                     device, dtype)
        except NoReference as exc:
            log.warning("load check skipped: transformers cannot build %s's first %d layers "
                        "(%s)", path, n, exc)
            return None
