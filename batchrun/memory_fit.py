"""Whether a model fits in memory, from its config alone: its weights as the options load them
(footprint.weights_bytes), its RoPE tables and a KV cache whose size the options fix, against
what the device has available. Asked by `run`, `serve`, sweeps, `plan` and `models check`
before anything is allocated."""

from __future__ import annotations

import torch

from batchrun import footprint
from batchrun.models.transformers.support import UnsupportedModelError
from batchrun.options.engine import EngineConfig


class WontFitError(UnsupportedModelError):
    """The model needs more memory than the machine has available (check_fits)."""


def rope_table_bytes(cfg) -> int:
    """A native model's float32 RoPE cos/sin tables (models/layers/rope.py: every position up
    to max_position_embeddings), a pair per kind of layer; 0 on the transformers backend, which
    computes them per step."""
    if not footprint.is_native(cfg):
        return 0
    kinds = len(set(getattr(cfg, "layer_types", None) or [None]))
    return kinds * 2 * cfg.max_position_embeddings * cfg.head_dim * 4


def available_memory(device: torch.device) -> int:
    """Bytes a load may still take: the GPU's free memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(cfg, engine_config: EngineConfig, model: str | None = None,
               available: int | None = None) -> None:
    """WontFitError when the weights of `cfg`'s model as `engine_config` loads it, its RoPE
    tables and a KV cache whose size the options fix (--kv-cache-memory; otherwise the engine
    sizes the cache from what is free after the load) need more than `available` (default:
    available_memory): said before anything is allocated. `model`: the spec `cfg` was read from
    (under --quantization gguf, its .gguf file's blocks are counted)."""
    dev = footprint.device_of(engine_config.device.device)
    device = engine_config.device
    parts = [("its RoPE tables", rope_table_bytes(cfg), "")]
    cache = engine_config.cache
    if cache.kv_cache_memory is not None or cache.num_blocks is not None:
        parts.append(("the KV cache", footprint.kv_reservation(engine_config, cfg, dev)[1],
                      "--kv-cache-memory"))
    have = available_memory(dev) if available is None else available
    if footprint.is_native(cfg) and native_bytes_bound(cfg) + sum(n for _, n, _ in parts) <= have:
        return  # it fits even so: no exact count (transformers' meta model, for an MoE)
    from batchrun.models.quant import method

    gguf = None
    if method(device.quantization).needs_gguf:
        from batchrun.models.config.spec_config import gguf_file

        gguf = gguf_file(model)
    weights = footprint.weights_bytes(cfg, device.dtype, dev, device.quantization, gguf=gguf)
    parts.insert(0, ("its weights", weights,
                     f"{footprint.dtype_of(device.dtype, dev)}".removeprefix("torch.")))
    need = sum(n for _, n, _ in parts)
    if need > have:
        shown = ", ".join(f"{what} {_gib(n)}" + (f" ({note})" if note else "")
                          for what, n, note in parts if n >= need // 100)
        where = f"{dev} has" if dev.type == "cuda" else "this machine has"
        raise WontFitError(f"the model will not fit in memory: {shown}; {where} "
                           f"{_gib(have)} available (a smaller --dtype or "
                           "--quantization holds the weights in less)")


def native_bytes_bound(cfg) -> int:
    """More bytes than a native model's weights take in any dtype and quantization, from its
    config alone (weights_bytes counts a native MoE's experts on transformers' model, a few
    seconds of imports a load of one that plainly fits need not wait for): every projection,
    embedding, expert and norm counted in float32, with half as much again for what this
    leaves out (biases, routers, a packed copy of tied embeddings, quantization scales)."""
    from batchrun.models.transformers.config_features import expert_counts

    hf = cfg.hf_config
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    experts, _ = expert_counts(hf)
    expert_width = getattr(hf, "moe_intermediate_size", None) or cfg.intermediate_size
    shared_width = getattr(hf, "shared_expert_intermediate_size", None) or 0
    layer = (h * (2 * q + 2 * kv) + 3 * h * (cfg.intermediate_size + shared_width)
             + 3 * h * expert_width * experts + h * experts + 4 * h)
    return 6 * (2 * cfg.vocab_size * h + cfg.num_layers * layer + h)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_model_fits(model: str | None, engine_config: EngineConfig) -> None:
    """check_fits for `model` (as model_config_for reads it, under `engine_config`'s
    --model-impl and --trust-remote-code): what a load calls before it allocates."""
    cfg = footprint.model_config_for(model, engine_config.model_impl, engine_config.trust_remote_code)
    check_fits(cfg, engine_config, model)
