"""Calibration for W8A8: the largest |input| each linear's input channels reach on a short text
(and for an fp8 KV cache: the largest |K| and |V| of each layer, kv_absmax).

The text (calibration.txt, shipped in the package) was written for this purpose: English prose,
a letter, arithmetic Q&A, a chat turn, some German/French/Spanish, and code in Python,
JavaScript, SQL, Rust, JSON and shell, so the channels that code and prose each light up are both
seen. It shares nothing with the quality gate's HumanEval text (tests/unit/test_quant_calibration.py
checks). It runs through the float model once, in windows of WINDOW tokens that each start a
fresh sequence (the first positions carry this kind of model's largest activations), with no
engine. The result is cached per model under
batchrun.paths.cache_dir()/int8-calibration, keyed by the weight files' identity.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from batchrun.models.quant.decoder import as_decoder
from batchrun.models.quant.smoothing import record_input_max, record_output_max

log = logging.getLogger(__name__)
WINDOW = 256
VERSION = 2  # bump when what the cache holds, or how it is computed, changes (2: the logits input)
_SAMPLES, _CHUNK = 16, 1 << 16  # of each weight file's bytes hashed for its identity


def calibration_text() -> str:
    return resources.files("batchrun.models.quant").joinpath("calibration.txt").read_text("utf-8")


def token_windows(tokenizer_path: Path) -> list[list[int]]:
    from batchrun.models.text.tokenizer import load_tokenizer

    ids = load_tokenizer(tokenizer_path).encode(calibration_text())
    return [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW) if len(ids) - i >= 16]


def weights_identity(files: list[Path]) -> str:
    """A digest of the weight files: names, sizes, modification times, and SAMPLES chunks of
    each spread over the file (the first one the safetensors header: every tensor's name,
    shape and offset). A rewritten or copied file calibrates again, once."""
    digest = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with f.open("rb") as handle:
            for i in range(_SAMPLES):
                handle.seek(max(0, (stat.st_size - _CHUNK) * i // (_SAMPLES - 1)))
                digest.update(handle.read(_CHUNK))
    return digest.hexdigest()


def cache_path(files: list[Path], method: str, dtype: torch.dtype) -> Path:
    from batchrun.paths import cache_dir

    text = hashlib.sha256(calibration_text().encode()).hexdigest()[:16]
    key = hashlib.sha256(f"{VERSION}:{method}:{dtype}:{WINDOW}:{text}:{weights_identity(files)}"
                         .encode()).hexdigest()[:32]
    return cache_dir() / "int8-calibration" / f"{key}.pt"


def shown(windows: list[list[int]], what: str) -> Iterator[list[int]]:
    """The windows, with what the calibration is doing said as it goes (a first run takes
    minutes on a large model, at "loading model"): a line when it starts, a tqdm bar on a
    terminal's stderr (else a log line at each quarter), a line with the time when it ends."""
    from tqdm import tqdm

    tokens = sum(map(len, windows))
    log.info("%s: %d tokens of the calibration text through the float model, in %d windows "
             "(once per model: cached for the next load)", what, tokens, len(windows))
    start, quarter = time.perf_counter(), max(1, len(windows) // 4)
    with tqdm(total=len(windows), desc=what, unit="window", file=sys.stderr, disable=None,
              leave=False) as bar:
        for i, ids in enumerate(windows, 1):
            yield ids
            bar.update(1)
            if bar.disable and i % quarter == 0 and i < len(windows):
                log.info("%s: %d of %d windows (%.0f s)", what, i, len(windows),
                         time.perf_counter() - start)
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)


@torch.no_grad()
def run_float(model: nn.Module, windows: Iterator[list[int]] | list[list[int]],
              after: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None) -> None:
    """Each window through `model` (a native decoder) as one fresh sequence: a KV cache of the
    window's own length, the portable SDPA attention backend's prefill; `after(kv)` sees each
    window's K/V, [(k, v) [tokens, kv heads, head dim] per layer]."""
    for ids in windows:
        kv = window_forward(model, ids)[1]
        if after is not None:
            after(kv)


@torch.no_grad()
def window_forward(model: nn.Module, ids: list[int]
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(final hidden states, per-layer K/V) of `ids` through `model` as one fresh sequence."""
    from batchrun.engine.attention.base import StepLayout
    from batchrun.engine.attention.sdpa import SdpaBackend

    decoder = as_decoder(model)
    dtype, device = decoder.embed_tokens.weight.dtype, decoder.embed_tokens.weight.device
    t = len(ids)
    shapes = [(t, layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
              for layer in decoder.layers]
    kv = [(torch.zeros(shape, dtype=dtype, device=device),
           torch.zeros(shape, dtype=dtype, device=device)) for shape in shapes]
    layout = StepLayout.of([[0]], [0], [t], 0, t, device)  # the model's device (fp8 KV on CUDA)
    return decoder(torch.tensor(ids, device=device), layout.positions, kv,
                   SdpaBackend(dtype).build(layout)), kv


def _cached(path: Path, fits: Callable[[dict], bool], what: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, weights_only=True)
        if fits(cached):
            log.debug("%s from %s", what, path)
            return cached
    except (RuntimeError, OSError, ValueError) as exc:
        log.warning("ignoring the unreadable %s cache %s: %s", what, path, exc)
    return None


def _save(path: Path, stats: dict, what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(stats, tmp)
    os.replace(tmp, path)
    log.info("%s: cached at %s", what, path)


def input_maxima(model: nn.Module, linears: dict[str, nn.Linear], files: list[Path], tokenizer_path: Path,
                 method: str, logits: str | None = None,
                 run: Callable[[Iterator[list[int]]], None] | None = None) -> dict[str, torch.Tensor]:
    """{name: float32 [in_features]} for `linears` (float nn.Linear modules of `model`), and
    with `logits` a name for the logits layer's input (the model's final hidden states): from
    the cache when this model was calibrated before, else measured now (the windows through
    `run`, by default run_float's native forward) and cached."""
    path = cache_path(files, method, next(iter(linears.values())).weight.dtype)
    sizes = {n: m.in_features for n, m in linears.items()}
    if logits:
        sizes[logits] = as_decoder(model).embed_tokens.weight.shape[1]
    cached = _cached(path, lambda c: set(c) == set(sizes) and all(
        c[n].shape == (k,) for n, k in sizes.items()), "int8 calibration")
    if cached is not None:
        return cached
    windows = token_windows(tokenizer_path)
    final_hidden = record_output_max(model, sizes[logits]) if logits else contextlib.nullcontext()
    with record_input_max(linears) as stats, final_hidden as final:
        (run or functools.partial(run_float, model))(shown(windows, "int8 calibration"))
    if logits:
        stats[logits] = final
    _save(path, stats, "int8 calibration")
    return stats


def kv_absmax(model: nn.Module, files: list[Path], tokenizer_path: Path) -> torch.Tensor:
    """float32 [layers, 2]: each layer's largest |K| and |V| on the calibration text (what an
    fp8 KV cache's scales are set from: engine/attention/fp8_kv.py), cached like input_maxima."""
    decoder = as_decoder(model)
    path = cache_path(files, "kv-absmax", decoder.embed_tokens.weight.dtype)
    shape = (len(decoder.layers), 2)
    cached = _cached(path, lambda c: set(c) == {"absmax"} and c["absmax"].shape == shape,
                     "KV calibration")
    if cached is not None:
        return cached["absmax"]
    absmax = torch.zeros(shape)

    def note(kv):
        for i, (k, v) in enumerate(kv):
            absmax[i, 0] = max(absmax[i, 0], k.abs().max().float())
            absmax[i, 1] = max(absmax[i, 1], v.abs().max().float())

    windows = token_windows(tokenizer_path)
    run_float(model, shown(windows, "KV calibration"), note)
    _save(path, {"absmax": absmax}, "KV calibration")
    return absmax
