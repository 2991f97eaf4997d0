"""footprint: weight bytes and KV pool predicted from the config equal the loaded engine's."""

import time

import pytest
import torch

from batchrun import llm
from batchrun.options.engine import EngineConfig
from transformers import AutoModelForCausalLM

from batchrun.engine.kv_groups import kv_groups
from batchrun.models.transformers.model import TransformersModel
from batchrun.footprint import (compute, kv_reservation, model_config_for, parameter_count,
                                weights_bytes)
from tests.helpers import held_bytes
from tests.tiny_models import make_tiny


@pytest.fixture
def tiny_folder(tmp_path, smol_tokenizer):
    """A tiny random model folder with a real tokenizer, loadable by llm.load_from_path."""
    def make(arch, **overrides):
        folder = tmp_path / arch
        make_tiny(arch, folder, vocab_size=len(smol_tokenizer), **overrides)
        smol_tokenizer.save_pretrained(folder)
        return folder
    return make


@pytest.mark.parametrize("arch", ["llama", "tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("packed", [True, False])
def test_weights_bytes_equal_the_loaded_model(arch, packed, tiny_folder, monkeypatch):
    if not packed:
        monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    folder = tiny_folder(arch)
    cfg = model_config_for(str(folder))
    loaded = llm.load_from_path(folder, EngineConfig.default(device="cpu", num_blocks=8))
    model = loaded.engine.runner.model
    assert weights_bytes(cfg, "float32") == held_bytes(model)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    assert parameter_count(cfg) == sum(p.numel() for p in hf.parameters())


def test_bfloat16_halves_the_bytes(tiny_folder):
    cfg = model_config_for(str(tiny_folder("llama")))
    assert weights_bytes(cfg, "bfloat16") * 2 == weights_bytes(cfg, torch.float32)


@pytest.mark.parametrize("options", [
    {"kv_cache_memory": 3 << 20},
    {"num_blocks": 37},
    {},  # the default: a share of free memory, capped at max_num_seqs full-length sequences
    {"kv_cache_memory": 1 << 20, "kv_cache_dtype": "bfloat16", "max_model_len": 100},
    {"kv_cache_memory": 64 << 20, "max_num_seqs": 3, "block_size": 8},
])
@pytest.mark.parametrize("window", [None, 8])
def test_kv_reservation_equals_the_engine_pool(options, window, tiny_folder):
    """Llama, and Mistral with a sliding window of 8 (the transformers backend; its blocks
    held only over the window: engine/kv_groups.py)."""
    folder = tiny_folder("mistral", sliding_window=window) if window else tiny_folder("llama")
    cfg = model_config_for(str(folder))
    config = EngineConfig.default(device="cpu", **options)
    blocks, nbytes = kv_reservation(config, cfg)
    engine = llm.load_from_path(folder, config).engine
    assert blocks == engine.kv.num_blocks
    assert engine.kv.groups.windows == [window]
    assert nbytes == sum(k.nbytes + v.nbytes for k, v in engine.runner.tensors)


def test_fp8_and_int8_caches_hold_a_byte_per_element_plus_their_scales(tiny_folder):
    cfg = model_config_for(str(tiny_folder("llama")))
    f32, fp8, int8 = (kv_reservation(EngineConfig.default(device="cpu", num_blocks=37,
                                                          kv_cache_dtype=dt), cfg)[1]
                      for dt in ("float32", "fp8", "int8"))
    assert fp8 == f32 // 4 + 2 * 4 * cfg.num_layers  # a K and a V scale per layer
    rows = 2 * cfg.num_layers * 38 * 16 * cfg.num_kv_heads  # K and V rows of 37 + 1 blocks of 16
    assert int8 == f32 // 4 + 4 * rows  # a scale per row


def test_model_config_for_folder_gguf_and_registry(tmp_path, tiny_folder, capsys):
    folder = tiny_folder("qwen2")
    assert model_config_for(str(folder)).qkv_bias
    with pytest.raises(Exception, match="config.json"):
        model_config_for(str(tmp_path))
    start = time.perf_counter()
    cfg = model_config_for(None)  # the bundled smollm2-135m
    took = time.perf_counter() - start
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 49152, True)
    assert parameter_count(cfg) == 134_515_008
    with capsys.disabled():
        print(f"\nmodel_config_for(None): {took:.3f} s; weights {weights_bytes(cfg) / 2**20:.0f} MiB float32")


def test_model_config_for_an_unconverted_gguf_reads_its_metadata(tmp_path, monkeypatch, capsys):
    """Without the cached conversion, the GGUF's metadata (not its tensors) gives the config."""
    from batchrun.models.weights import registry

    gguf = registry.find_gguf(registry.lookup("smollm2-135m"))
    if gguf is None:
        pytest.skip("the bundled model is not installed")
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    start = time.perf_counter()
    cfg = model_config_for(str(gguf))
    took = time.perf_counter() - start
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 3, True)
    assert not (tmp_path / "cache").exists()  # nothing converted
    with capsys.disabled():
        print(f"\nmodel_config_for(gguf, not converted): {took:.2f} s")


@pytest.fixture
def backend_folder(tmp_path, smol_tokenizer):
    """A tiny random model of tests/tiny_models.BACKEND_ARCHS (native MoE ones included)."""
    from tests.tiny_models import BACKEND_ARCHS

    def make(arch, **overrides):
        folder = tmp_path / arch
        model = make_tiny(arch, folder, archs=BACKEND_ARCHS, vocab_size=len(smol_tokenizer),
                          **overrides)
        smol_tokenizer.save_pretrained(folder)
        return folder, model
    return make


# A native MoE with a shared expert and a dense layer, a windowed native model (gemma2: one
# window layer, one full), one without RMSNorm/SwiGLU (gpt_neox), MLA (deepseek_v2), and a native
# MoE with sinks, biases and windows (gpt_oss), a native model with LayerNorms and per-head q/k
# norms (stablelm), chunked attention beside full layers and a shared-expert MoE (llama4_text),
# indexed attention whose cache widens for the indexer's keys (glm_moe_dsa).
@pytest.mark.parametrize("arch,impl", [
    ("qwen2_moe", "native"), ("mixtral", "native"), ("gemma2", "native"), ("stablelm", "native"),
    ("gpt_neox", "transformers"), ("deepseek_v2", "transformers"), ("gpt_oss", "native"),
    ("llama4_text", "transformers"), ("glm_moe_dsa", "transformers")])
def test_every_path_is_sized_as_the_engine_holds_it(arch, impl, backend_folder):
    """Parameters equal transformers' model's, weight bytes what the loaded model holds, and
    the KV pool (its groups, blocks and bytes) what the engine allocates."""
    folder, reference = backend_folder(arch, tie_word_embeddings=arch == "gpt_neox")
    cfg = model_config_for(str(folder))
    assert parameter_count(cfg) == sum(p.numel() for p in reference.parameters())
    config = EngineConfig.default(device="cpu", kv_cache_memory=1 << 20, block_size=8)
    blocks, nbytes = kv_reservation(config, cfg)
    engine = llm.load_from_path(folder, config).engine
    model = engine.runner.model
    assert isinstance(model, TransformersModel) == (impl == "transformers")
    assert weights_bytes(cfg, "float32") == held_bytes(model)
    assert (blocks, engine.kv.groups) == (engine.kv.num_blocks, kv_groups(model.config))
    assert engine.kv.groups == kv_groups(cfg)
    assert nbytes == sum(k.nbytes + v.nbytes for k, v in engine.runner.tensors)


def test_moe_quantized_weights_equal_the_loaded_model(backend_folder):
    folder, _ = backend_folder("qwen2_moe")
    cfg = model_config_for(str(folder))
    config = EngineConfig.default(device="cpu", num_blocks=8, quantization="int8-weight")
    model = llm.load_from_path(folder, config).engine.runner.model
    assert weights_bytes(cfg, "float32", quantization="int8-weight") == held_bytes(model)


def test_moe_active_parameters_and_flops_by_hand(backend_folder):
    """qwen2_moe of tests/tiny_models: hidden 128, 4 heads (head dim 32), 2 KV heads, QKV bias,
    layer 0 sparse (router 4 experts, 2 per token, expert width 64, shared expert 96 with its
    gate), layer 1 dense (256), vocab V untied."""
    folder, reference = backend_folder("qwen2_moe")
    cfg = model_config_for(str(folder))
    h, v = 128, cfg.vocab_size
    attention = h * (128 + 2 * 64) + (128 + 2 * 64) + 128 * h + 2 * h  # qkv(+bias), o, norms
    sparse = h * 4 + 2 * 3 * h * 64 + 3 * h * 96 + h  # router, 2 experts, shared expert, gate
    dense = 3 * h * 256
    active = 2 * v * h + 2 * attention + sparse + dense + h  # embed, lm_head, final norm
    got = compute(cfg)
    assert got.active_parameters == active
    assert got.parameters == active + 2 * 3 * h * 64  # the 2 experts a token skips
    assert got.layer_flops == 2 * (active - 2 * v * h)
    assert got.logits_flops == 2 * v * h and got.attention_flops == 4 * 2 * 4 * 32


def test_a_vlm_on_a_windowed_decoder_is_sized_as_the_backend_holds_it(tmp_path, smol_tokenizer):
    """Gemma 3 (a sliding and a full layer): whole-model weights, its decoder's KV groups."""
    from tests.tiny_vlms import make_tiny_vlm

    hf, *_ = make_tiny_vlm("gemma3", tmp_path, smol_tokenizer)
    cfg = model_config_for(str(tmp_path))
    config = EngineConfig.default(device="cpu", kv_cache_memory=1 << 20)
    blocks, nbytes = kv_reservation(config, cfg)
    engine = llm.load_from_path(tmp_path, config).engine
    assert weights_bytes(cfg, "float32") == held_bytes(engine.runner.model) == \
        4 * sum(p.numel() for p in hf.parameters())
    assert (blocks, kv_groups(cfg)) == (engine.kv.num_blocks, engine.kv.groups)
    assert len(engine.kv.groups.groups) == 2
    assert nbytes == sum(k.nbytes + v.nbytes for k, v in engine.runner.tensors)


def test_int8_weights_of_tied_embeddings_equal_the_loaded_model(tiny_folder):
    """Tied embeddings under --quantization int8: the logits layer is its own int8 copy (this
    count raised a NameError)."""
    folder = tiny_folder("tied")
    cfg = model_config_for(str(folder))
    config = EngineConfig.default(device="cpu", num_blocks=8, quantization="int8")
    model = llm.load_from_path(folder, config).engine.runner.model
    assert weights_bytes(cfg, "float32", quantization="int8") == held_bytes(model)
