"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), local or an
fsspec URL: its config read and checked against what batchrun runs and against the base model's
shapes, its weights read into (layer, module) -> (A [r, in], B [out, r]).

Checked up front (`read_adapter(..., weights=False)` reads only the config and the safetensors
header, so a start-up check of many adapters costs no weight reads): PEFT type LoRA, no DoRA, no
bias, no modules_to_save, no rank or alpha patterns, the rank at most max_lora_rank; against the
base model's targets (targets.py): only plain linears inside its decoder layers, every tensor's
shape that of its module.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from batchrun.models.lora.targets import LoraTargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A LoRA tensor of a PEFT checkpoint: the full module name it updates, A or B.
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
# Config fields whose non-default value changes what the adapter computes, and so is refused.
_REFUSED = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save",
            "rank_pattern": "per-module ranks (rank_pattern)",
            "alpha_pattern": "per-module alphas (alpha_pattern)",
            "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "lora_bias",
            "target_parameters": "target_parameters", "use_qalora": "QA-LoRA",
            "layer_replication": "layer_replication"}


class LoraError(ValueError):
    """An adapter batchrun cannot run; the message names the adapter and what is wrong."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with use_rslora
    modules: tuple[str, ...]  # the PEFT modules it targets (q_proj, ...)
    # (layer, module path in the layer) it holds weights for (targets.py's keys)
    where: frozenset[tuple[int, str]] = frozenset()
    # (layer, module) -> (A [r, in], B [out, r]); empty when read without weights.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def _read(path: str, limit: int | None = None) -> bytes:
    import fsspec

    with fsspec.open(path, "rb") as f:
        return f.read() if limit is None else f.read(limit)


def _fail(name: str, path: str, what: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r} ({path}): {what}")


def _targets(raw, name: str, path: str) -> str | tuple[str, ...]:
    """target_modules as PEFT reads it: a regex over full module names, or names (a module
    matches one by its last components), or "all-linear"."""
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise _fail(name, path, f"target_modules {targets!r} is not a regex: {exc}") from None
        return targets
    if isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        return tuple(dict.fromkeys(targets))
    raise _fail(name, path, f"target_modules must name modules, got {targets!r}")


def _selectors(spec: str | tuple[str, ...]) -> list[tuple[str, Callable[[str], bool]]]:
    """(the entry, whether a full module name matches it) for each entry of target_modules."""
    if spec == "all-linear":
        return [(spec, lambda full: True)]
    if isinstance(spec, str):
        return [(spec, lambda full: re.fullmatch(spec, full) is not None)]
    return [(t, _name_match(t)) for t in spec]


def _name_match(name: str) -> Callable[[str], bool]:
    """Whether a full module name is `name` or ends in it."""
    return lambda full: full == name or full.endswith("." + name)


def targeted(spec: str | tuple[str, ...], targets: LoraTargets, name: str,
             path: str) -> set[tuple[int, str]]:
    """The (layer, path) targets the adapter's target_modules select; LoraError naming an
    entry that selects no plain linear of a decoder layer (and what it selects instead)."""
    chosen: set[tuple[int, str]] = set()
    for entry, match in _selectors(spec):
        hits = {key for key in targets.targets if match(targets.full_name(*key))}
        chosen |= hits
        if hits or spec == "all-linear":
            continue
        other = next(((full, kind) for full, kind in targets.others.items() if match(full)), None)
        if other is not None:
            raise _fail(name, path, f"target module {entry!r}: {_not_a_target(targets, *other)}")
        raise _fail(name, path, f"target module(s) {entry} are not supported: no linear of the "
                                f"base model's decoder layers is named so; LoRA applies to "
                                f"{', '.join(targets.module_names())}")
    return chosen


def _not_a_target(targets: LoraTargets, full: str, kind: str) -> str:
    what = (f"{full} is a {kind}, not a plain linear" if targets.parse(full) else
            f"{full} is outside the decoder layers ({targets.layers_path})")
    return (f"{what}; LoRA applies only to the plain linears of the decoder layers: "
            f"{', '.join(targets.module_names())}")


def read_config(name: str, path: str, max_rank: int) -> tuple[int, float, str | tuple[str, ...]]:
    """(rank, scaling, target_modules) from the folder's adapter_config.json."""
    try:
        raw = json.loads(_read(_join(path, CONFIG_FILE)))
    except FileNotFoundError:
        raise _fail(name, path, f"no {CONFIG_FILE}" if _exists(path) else
                    "no such adapter folder") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(name, path, f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _fail(name, path, f"{CONFIG_FILE} is not a JSON object")
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _fail(name, path, f"peft_type {kind!r} is not supported (LORA only)")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise _fail(name, path, f"{what} is not supported")
    if raw.get("bias", "none") != "none":
        raise _fail(name, path, f"bias={raw['bias']!r} is not supported (bias='none' only)")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _fail(name, path, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(name, path, f"rank {rank} is above --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return rank, float(scaling), _targets(raw, name, path)


def _header(data: bytes, total: int | None, name: str, path: str) -> dict:
    """The safetensors header (tensor name -> dtype, shape, offsets), its size checked."""
    if len(data) < 8:
        raise _fail(name, path, f"{WEIGHTS_FILE} is corrupt or not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > 100 << 20 or len(data) < 8 + size:
        raise _fail(name, path, f"{WEIGHTS_FILE} is corrupt or not a safetensors file (bad header)")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        raise _fail(name, path, f"{WEIGHTS_FILE} is corrupt or not a safetensors file (bad header)") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if total is not None and total != 8 + size + end:
        raise _fail(name, path, f"{WEIGHTS_FILE} is truncated or corrupt ({total} bytes, its "
                                f"header says {8 + size + end})")
    return header


def _check_shapes(shapes: dict[str, list[int]], rank: int, chosen: set[tuple[int, str]],
                  targets: LoraTargets, name: str,
                  path: str) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module path) -> {"A": key, "B": key}, every shape checked against the base."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(name, path, f"tensor {key!r} is not a LoRA weight of a supported "
                                    "projection (DoRA magnitudes, embeddings and biases are not "
                                    "supported)")
        module, ab = m[1], m[2]
        where = targets.parse(module)
        target = targets.targets.get(where) if where else None
        if target is None:
            if module in targets.others:
                raise _fail(name, path, f"tensor {key!r}: "
                                        f"{_not_a_target(targets, module, targets.others[module])}")
            if where and where[0] >= len(targets.layers):
                raise _fail(name, path, f"tensor {key!r}: the base model has "
                                        f"{len(targets.layers)} layers (an adapter for another "
                                        "base model?)")
            raise _fail(name, path, f"tensor {key!r}: the base model has no linear {module} "
                                    f"(an adapter for another base model?); LoRA applies to "
                                    f"{', '.join(targets.module_names())}")
        if where not in chosen:
            raise _fail(name, path, f"tensor {key!r}: {module} is not in target_modules")
        want = [rank, target.in_features] if ab == "A" else [target.out_features, rank]
        if list(shape) != want:
            raise _fail(name, path, f"tensor {key!r} has shape {list(shape)}, the base model "
                                    f"needs {want} (an adapter for another base model?)")
        found.setdefault(where, {})[ab] = key
    if not found:
        raise _fail(name, path, f"{WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise _fail(name, path, f"layer {layer} {module}: lora_A and lora_B must both be "
                                    "present")
    return found


def read_adapter(name: str, path: str, targets: LoraTargets, max_rank: int,
                 weights: bool = True) -> LoraAdapter:
    """The adapter at `path`, checked against the base model's targets. weights=False reads
    only the config and the weights' header (a start-up check); LoraError for anything wrong."""
    path = str(path)
    rank, scaling, spec = read_config(name, path, max_rank)
    chosen = targeted(spec, targets, name, path)
    file = _join(path, WEIGHTS_FILE)
    try:
        data = _read(file) if weights else _read(file, 1 << 20)
        total = len(data) if weights else _size(file)
    except FileNotFoundError:
        raise _fail(name, path, f"no {WEIGHTS_FILE} (only safetensors weights are read)") from None
    if not weights and len(data) >= 8:
        (size,) = struct.unpack("<Q", data[:8])
        if 8 + size > len(data) and size <= 100 << 20:
            data = _read(file, 8 + size)
    header = _header(data, total, name, path)
    keys = _check_shapes({k: v["shape"] for k, v in header.items()}, rank, chosen, targets,
                         name, path)
    modules = tuple(dict.fromkeys(p.rsplit(".", 1)[-1] for _, p in sorted(keys)))
    adapter = LoraAdapter(name, path, rank, scaling, modules, frozenset(keys))
    if weights:
        from safetensors.torch import load

        try:
            tensors = load(data)
        except Exception as exc:  # safetensors raises its own error types
            raise _fail(name, path, f"{WEIGHTS_FILE} cannot be read: {exc}") from None
        for key, tensor in tensors.items():  # NaN or inf would turn every output it touches
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise _fail(name, path, f"tensor {key!r} holds non-finite values (NaN or inf)")
        adapter.weights = {where: (tensors[pair["A"]], tensors[pair["B"]])
                           for where, pair in keys.items()}
    return adapter


def _exists(path: str) -> bool:
    import fsspec

    fs, _, (local,) = fsspec.get_fs_token_paths(path)
    return bool(fs.exists(local))


def _size(path: str) -> int:
    import fsspec

    fs, _, (local,) = fsspec.get_fs_token_paths(path)
    return int(fs.size(local))
