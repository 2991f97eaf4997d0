"""memory_fit.check_fits: a model whose weights (with its RoPE tables and a KV cache of a fixed
size) need more memory than is available is refused before anything is allocated; the quick
bound that lets a native model that plainly fits skip the exact count is never below it."""

from __future__ import annotations

import pytest

from batchrun import footprint, memory_fit
from batchrun.options.engine import EngineConfig
from tests.tiny_models import BACKEND_ARCHS, tiny_config

NATIVE = ["llama", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe",
          "gpt_oss"]


def _cfg(arch, tmp_path, **overrides):
    config = tiny_config(arch, BACKEND_ARCHS, **overrides)
    config.architectures = [BACKEND_ARCHS[arch][1]]
    config.save_pretrained(tmp_path)
    return footprint.model_config_for(str(tmp_path))


@pytest.mark.parametrize("arch", NATIVE)
def test_the_quick_bound_is_above_the_exact_weights(arch, tmp_path):
    cfg = _cfg(arch, tmp_path)
    exact = max(footprint.weights_bytes(cfg, dtype) for dtype in ("float32", "bfloat16"))
    assert exact < memory_fit.native_bytes_bound(cfg) < 3 * exact


def test_a_model_is_refused_exactly_when_it_needs_more_than_is_available(tmp_path):
    cfg = _cfg("llama", tmp_path)
    engine = EngineConfig.default()
    need = footprint.weights_bytes(cfg, "float32") + memory_fit.rope_table_bytes(cfg)
    memory_fit.check_fits(cfg, engine, available=need)  # exactly enough
    with pytest.raises(memory_fit.WontFitError, match=r"its weights .* \(float32\).* available"):
        memory_fit.check_fits(cfg, engine, available=need - 1)
    # a KV cache whose size the options fix counts too
    fixed = EngineConfig.default(num_blocks=100_000)
    kv = footprint.kv_reservation(fixed, cfg)[1]
    memory_fit.check_fits(cfg, fixed, available=need + kv)
    with pytest.raises(memory_fit.WontFitError, match=r"the KV cache"):
        memory_fit.check_fits(cfg, fixed, available=need + kv - 1)


def test_bfloat16_halves_what_must_fit(tmp_path):
    cfg = _cfg("llama", tmp_path)
    need = footprint.weights_bytes(cfg, "bfloat16") + memory_fit.rope_table_bytes(cfg)
    memory_fit.check_fits(cfg, EngineConfig.default(dtype="bfloat16"), available=need)
    with pytest.raises(memory_fit.WontFitError):
        memory_fit.check_fits(cfg, EngineConfig.default(), available=need)
