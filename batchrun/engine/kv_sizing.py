"""How many KV blocks, of which element type, the engine llm.build_engine makes gets; needs no
weights (footprint.py and the plan's estimator size a job with it)."""

from __future__ import annotations

import torch

from batchrun.engine.devices import pick_dtype
from batchrun.engine.kv_groups import kv_block_bytes, kv_groups
from batchrun.options.engine import EngineConfig

CPU_DEFAULT_KV_BYTES = 4 << 30
# The pool of a model without attention layers: its blocks take no memory, the bound only keeps
# the manager's bookkeeping small.
ZERO_BYTE_BLOCKS = 1 << 16


def kv_layout(config: EngineConfig, model_cfg, device: torch.device, dtype: torch.dtype,
              auto: torch.dtype | None = None) -> tuple[int, int, torch.dtype]:
    """(KV blocks, max_model_len, KV dtype) of the engine build_engine makes; needs no weights.
    `auto`: the KV dtype --kv-cache-dtype auto means (the model's `dtype` unless the
    --quantization method says otherwise: models/quant/methods.py default_kv_dtype)."""
    max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                        model_cfg.max_position_embeddings)
    kv_dtype = kv_dtype_of(config.cache.kv_cache_dtype, device, dtype, auto)
    return kv_blocks_for(config, model_cfg, device, kv_dtype, max_model_len), max_model_len, kv_dtype


def kv_dtype_of(name: str, device: torch.device, dtype: torch.dtype,
                auto: torch.dtype | None = None) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `name`; auto: `auto`, else the model's
    `dtype`."""
    from batchrun.engine.attention.fp8_kv import NAMES as FP8_NAMES

    if name in FP8_NAMES:  # the CPU's C kernels and CUDA's Triton kernels read e4m3
        return FP8_NAMES[name]
    if name == "int8":
        if device.type != "cpu":
            raise ValueError("--kv-cache-dtype int8 runs on the CPU only (no CUDA attention "
                             "kernel reads its per-row scales); use fp8, bfloat16 or float16 there")
        return torch.int8
    if name == "auto":
        return dtype if auto is None else auto
    return pick_dtype(name, device)


def kv_blocks_for(config: EngineConfig, model_cfg, device: torch.device, dtype: torch.dtype,
                  max_model_len: int) -> int:
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    block_bytes = kv_block_bytes(model_cfg, cache.block_size, dtype.itemsize,
                                 4 if dtype == torch.int8 else 0)  # attention/int8_kv.py
    # More than every sequence at full length can never be used (a sliding-window layer's
    # blocks only over its window: engine/kv_groups.py).
    most = config.scheduler.max_num_seqs * kv_groups(model_cfg).blocks_per_sequence(
        max_model_len, cache.block_size, config.scheduler.max_num_batched_tokens)
    state = state_bytes(config, model_cfg, device)
    budget = kv_budget(config, device) - state
    # (a model without state and a budget below one block gets one: the memory fit refuses it
    # by its whole footprint)
    if state and (budget < block_bytes or budget < 0):
        raise ValueError(f"the KV cache memory ({kv_budget(config, device)} bytes) does not hold "
                         f"the recurrent state of one sequence ({state} bytes) and a KV block; "
                         "raise --kv-cache-memory")
    if block_bytes == 0:  # no attention layers (Mamba): blocks only count positions
        return max(1, min(most, ZERO_BYTE_BLOCKS))
    return max(1, min(budget // block_bytes, most))


# The share of the KV budget state slots may take when --max-num-seqs asks more: the rest
# stays for the blocks of the attention layers.
STATE_SHARE = 0.5


def state_slot_count(config: EngineConfig, model_cfg, device: torch.device) -> int:
    """How many state slots (engine/state_slots.py) a model with recurrent state gets: one per
    sequence --max-num-seqs lets run, fewer where those would take more than STATE_SHARE of the
    KV budget (a sequence without a slot waits, as one without blocks does); 0 without state."""
    per_sequence = getattr(model_cfg, "state_bytes_per_sequence", 0)
    if not per_sequence:
        return 0
    fit = int(kv_budget(config, device) * STATE_SHARE) // per_sequence
    return max(1, min(config.scheduler.max_num_seqs, fit))


# The share of the KV budget state checkpoints (prefix caching of a model with state) may take,
# and the most of them per state slot: enough for every running sequence's prompt to leave a
# few behind, without allocating a tiny model's checkpoints by the gigabyte.
CHECKPOINT_SHARE = 0.25
CHECKPOINTS_PER_SLOT = 4


def state_checkpoint_count(config: EngineConfig, model_cfg, device: torch.device) -> int:
    """How many state checkpoints (engine/state_checkpoints.py) a model with recurrent state
    keeps for prefix caching; 0 with the prefix cache off or layers that cannot write them."""
    per_sequence = getattr(model_cfg, "state_bytes_per_sequence", 0)
    if not (per_sequence and config.cache.enable_prefix_caching
            and getattr(model_cfg, "state_checkpoints", False)):
        return 0
    fit = int(kv_budget(config, device) * CHECKPOINT_SHARE) // per_sequence
    return min(fit, CHECKPOINTS_PER_SLOT * state_slot_count(config, model_cfg, device))


def checkpoint_interval(config: EngineConfig) -> int:
    """Tokens between state checkpoints: --state-checkpoint-tokens rounded down to whole KV
    blocks (at least one)."""
    bs = config.cache.block_size
    return max(bs, config.cache.state_checkpoint_tokens // bs * bs)


def state_bytes(config: EngineConfig, model_cfg, device: torch.device) -> int:
    """The state slots' and checkpoints' bytes the KV budget also pays for; 0 for a model
    without state."""
    return (state_slot_count(config, model_cfg, device)
            + state_checkpoint_count(config, model_cfg, device)) * \
        getattr(model_cfg, "state_bytes_per_sequence", 0)


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """The bytes of KV blocks and state slots together: --kv-cache-memory, else a share of what
    the device has free."""
    budget: int | None = config.cache.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.8)
        else:
            import psutil

            budget = min(CPU_DEFAULT_KV_BYTES, int(psutil.virtual_memory().available * 0.3))
    return budget
