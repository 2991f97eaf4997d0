"""Fuzzing of model folders (issue 42): mutated config.json values, truncated and corrupted
safetensors headers, weights of the wrong dtype or shape, damaged GGUF files, unreadable .bin
pickles and hostile quantization configs, each run through the CLI in this process (`run` and
`models check` on the real loader, tests/model_folders.py's tiny Llama).

Asserted for every case: exit code 2, a message naming the file (and the field where there is
one), no traceback, and nothing allocated from the bad value. The untouched folder runs (exit
0), so a refusal is the mutation's. BATCHRUN_FUZZ_EXAMPLES scales the generated examples as in
test_request_fuzz.py (default 1: a few seconds).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.model_folders import CONFIG, cli, refused, run_on, tiny_folder, weights

SCALE = float(os.environ.get("BATCHRUN_FUZZ_EXAMPLES", "1"))


def budget(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


def variant(base, where, config=None, files=None, drop=()):
    """A copy of the tiny folder at `where` with config.json updated by `config` (a key set to
    ... removed), files replaced by `files` (name -> bytes or text), `drop` removed."""
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(base, where)
    for name in drop:
        (where / name).unlink()
    if config is not None:
        values = {**CONFIG, **config}
        (where / "config.json").write_text(json.dumps(
            {k: v for k, v in values.items() if v is not ...}))
    for name, content in (files or {}).items():
        (where / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return where


def test_the_untouched_folder_runs(base, tmp_path):
    result = run_on(base, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200


# --- config.json --------------------------------------------------------------------------

SIZE_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"]
# No model has a size of zero or less, or of 2^31 and more; none is a fraction, text or a list.
hostile_sizes = (st.integers(max_value=0) | st.integers(min_value=2 ** 31, max_value=2 ** 80)
                 | st.floats(allow_nan=False, allow_infinity=False)  # NaN, inf: below
                 | st.text(max_size=6) | st.booleans()
                 | st.lists(st.integers(1, 64), max_size=2)
                 | st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))


@budget(12)
@given(field=st.sampled_from(SIZE_FIELDS), value=hostile_sizes)
def test_a_size_out_of_type_or_range_is_refused_naming_the_field(base, tmp_path_factory, field,
                                                                  value):
    folder = variant(base, tmp_path_factory.mktemp("cfg") / "m", config={field: value})
    refused(cli("models", "check", str(folder)), "config.json", field)


# Any key transformers' config classes or batchrun read, set to any JSON value: a verdict either
# way (the value may be harmless), never a traceback.
ANY_KEYS = sorted(set(CONFIG) | {
    "rope_scaling", "rope_parameters", "model_type", "sliding_window", "layer_types",
    "attention_bias", "dtype", "quantization_config", "num_local_experts", "num_experts_per_tok",
    "text_config", "vision_config", "partial_rotary_factor", "use_sliding_window", "id2label",
    "label2id", "num_labels", "pad_token_id", "attn_logit_softcapping", "moe_intermediate_size"})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["llama", "qwen3_moe", "gemma2", "linear", "yarn", "default", "silu"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["rope_type", "factor", "rope_theta", "quant_method", "bits", "0"]),
        inner, max_size=3), max_leaves=6)


@budget(10)
@given(changes=st.dictionaries(st.sampled_from(ANY_KEYS), json_values, min_size=1, max_size=3))
def test_any_value_under_any_key_gets_a_verdict_not_a_traceback(base, tmp_path_factory, changes):
    folder = variant(base, tmp_path_factory.mktemp("cfg") / "m", config=changes)
    result = cli("models", "check", str(folder))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        (changes, result.exception)
    assert result.exit_code in (0, 2), (changes, result.output)


@pytest.mark.parametrize("config,field", [
    ({"hidden_size": 10 ** 9}, "hidden_size"),  # issue 42: 22 billion GiB, then an allocation
    ({"num_hidden_layers": 10 ** 7}, "num_hidden_layers"),  # allocated until memory ran out
    ({"hidden_size": -128}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),  # was max() of an empty sequence
    ({"hidden_size": None}, "hidden_size"),  # transformers' default would be another model
    ({"num_attention_heads": 3, "head_dim": ...}, "hidden_size"),  # 32 / 3 heads
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 heads in 3 groups
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"layer_types": ["full_attention"]}, "layer_types"),  # one entry for two layers
    ({"quantization_config": "notadict"}, "quantization_config"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"text_config": {"hidden_size": -1}}, "text_config.hidden_size"),
    ({"vision_config": {}}, "vision_config"),  # a Llama has no vision tower to read it into
    ({"id2label": {"type": "a"}}, "id2label"),
    ({"architectures": ["LlamaForCausalLM", None]}, "architectures"),
    ({"bos_token_id": {"x": 1}}, "bos_token_id"),  # transformers' own check, named
])
def test_issue_42s_configs_are_refused_by_run_and_check(base, tmp_path, config, field):
    folder = variant(base, tmp_path / "m", config=config)
    refused(cli("models", "check", str(folder)), "config.json", field)
    refused(run_on(folder, tmp_path), "config.json", field)


@pytest.mark.parametrize("text", [
    '{"hidden_size": NaN}', '{"vocab_size": Infinity}', "[1, 2]", "null", '"config"',
    "[" * 100_000, '{"model_type": "llama", ', "\xff\xfe not text",
])
def test_a_config_that_is_not_a_json_object_is_refused(base, tmp_path, text):
    folder = variant(base, tmp_path / "m", files={"config.json": text.encode("latin-1")})
    refused(cli("models", "check", str(folder)), "config.json")


@pytest.mark.parametrize("name,text,said", [
    ("generation_config.json", '{"eos_token_id": 2', "generation_config.json"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id"),
    ("generation_config.json", '{"eos_token_id": [2, -7]}', "eos_token_id"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json"),
    ("tokenizer.json", '{"model": {"type": "Nonsense"}}', "tokenizer files"),
    ("tokenizer.json", "", "tokenizer files"),
])
def test_a_damaged_tokenizer_or_generation_config_is_refused(base, tmp_path, name, text, said):
    folder = variant(base, tmp_path / "m", files={name: text})
    refused(run_on(folder, tmp_path), said)


def test_a_model_that_does_not_fit_is_refused_before_loading(base, tmp_path):
    # In range, but 65536-wide with 1024 layers: about 200 TiB of weights.
    folder = variant(base, tmp_path / "m", config={
        "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 1024,
        "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 512})
    check = cli("models", "check", str(folder))
    refused(check, "will not fit in memory", "GiB available")
    assert "it runs the model exactly" not in check.output
    refused(run_on(folder, tmp_path), "will not fit in memory")
    lines = tmp_path / "in.jsonl"
    refused(cli("plan", str(lines), "--model", str(folder)), "will not fit in memory")


# --- safetensors ----------------------------------------------------------------------------

def _header(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


@budget(6)
@given(cut=st.floats(0.0, 0.9999))
def test_a_truncated_safetensors_file_is_refused_by_name(base, tmp_path_factory, cut):
    raw = (base / "model.safetensors").read_bytes()
    folder = variant(base, tmp_path_factory.mktemp("st") / "m",
                     files={"model.safetensors": raw[:int(len(raw) * cut)]})
    refused(run_on(folder, folder.parent), "model.safetensors")


NAMES = sorted(weights())
lies = st.one_of(
    st.tuples(st.just("shape"), st.lists(st.integers(0, 70), min_size=1, max_size=3)),
    st.tuples(st.just("dtype"), st.sampled_from(["F16", "BF16", "I32", "I64", "U8", "BOOL", "F64",
                                                 "F8_E4M3", "X"])),
    st.tuples(st.just("data_offsets"), st.lists(st.integers(-2, 10 ** 7), min_size=2,
                                                max_size=2)),
)


@budget(10)
@given(name=st.sampled_from(NAMES), lie=lies)
def test_a_lying_safetensors_header_is_refused_by_name(base, tmp_path_factory, name, lie):
    header, body = _header((base / "model.safetensors").read_bytes())
    key, value = lie
    if header[name][key] == value:
        value = value + [1] if isinstance(value, list) else "X"
    header[name][key] = value
    folder = variant(base, tmp_path_factory.mktemp("st") / "m",
                     files={"model.safetensors": _with_header(header, body)})
    refused(run_on(folder, folder.parent), "model.safetensors")


def _resaved(change) -> bytes:
    from safetensors.torch import save

    tensors = weights()
    change(tensors)
    return save({k: v.contiguous() for k, v in tensors.items()})


@pytest.mark.parametrize("change,said", [
    # copy_ would have broadcast these silently
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:1]}), "shape [1]"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:1]}), "the config makes it"),
    (lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].T}),
     "the config makes it"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                         t["model.layers.0.self_attn.q_proj.weight"][:, :16]}), "shape"),
    # cast silently
    (lambda t: t.update({"model.layers.1.mlp.down_proj.weight":
                         t["model.layers.1.mlp.down_proj.weight"].to(torch.int32)}), "int32"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"] > 0}), "bool"),
    (lambda t: t.update({"model.layers.5.mlp.up_proj.weight":
                         t["model.layers.0.mlp.up_proj.weight"].clone()}), "layers.5"),
    (lambda t: t.pop("model.layers.1.input_layernorm.weight"), "lacks weights"),
    (lambda t: t["model.layers.0.mlp.gate_proj.weight"].view(-1)[7].fill_(float("nan")),
     "non-finite"),
])
def test_weights_of_the_wrong_shape_or_dtype_are_refused_by_name(base, tmp_path, change, said):
    folder = variant(base, tmp_path / "m", files={"model.safetensors": _resaved(change)})
    refused(run_on(folder, tmp_path), "model.safetensors", said)


@pytest.mark.parametrize("change,said", [
    # transformers would re-initialise these at random, or cast them, and run
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:1]}), "the config makes it"),
    (lambda t: t.pop("model.layers.1.input_layernorm.weight"), "lacks weights"),
    (lambda t: t.update({"model.layers.1.mlp.down_proj.weight":
                         t["model.layers.1.mlp.down_proj.weight"].to(torch.int32)}), "I32"),
])
def test_the_transformers_backend_refuses_them_too(base, tmp_path, change, said):
    folder = variant(base, tmp_path / "m", files={"model.safetensors": _resaved(change)})
    refused(run_on(folder, tmp_path, "--model-impl", "transformers"), "model.safetensors", said)


# --- GGUF -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF file with a llama header and two small tensors (no tokenizer: enough to be read,
    not to run)."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(64)])
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tiny_gguf_reads(tiny_gguf):
    from batchrun.models.weights.gguf_check import check_gguf

    check_gguf(tiny_gguf)  # the reference: what the mutations below break


def _patched(raw: bytes, at: int, fmt: str, value) -> bytes:
    return raw[:at] + struct.pack("<" + fmt, value) + raw[at + struct.calcsize("<" + fmt):]


GGUF_DAMAGE = {
    "bad magic": lambda raw: b"GGUX" + raw[4:],
    "version 1": lambda raw: _patched(raw, 4, "I", 1),
    "2^60 tensors": lambda raw: _patched(raw, 8, "Q", 2 ** 60),
    "2^60 metadata keys": lambda raw: _patched(raw, 16, "Q", 2 ** 60),
    "a key 2^62 bytes long": lambda raw: _patched(raw, 24, "Q", 2 ** 62),
    "empty": lambda raw: b"",
}


@pytest.mark.parametrize("damage", list(GGUF_DAMAGE))
def test_a_damaged_gguf_is_refused_by_name(tiny_gguf, tmp_path, damage):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(GGUF_DAMAGE[damage](tiny_gguf.read_bytes()))
    refused(cli("models", "check", str(path)), "damaged.gguf")
    refused(run_on(path, tmp_path), "damaged.gguf")


@budget(6)
@given(cut=st.floats(0.0, 0.999))
def test_a_truncated_gguf_is_refused_by_name(tiny_gguf, tmp_path_factory, cut):
    raw = tiny_gguf.read_bytes()
    path = tmp_path_factory.mktemp("gguf") / "cut.gguf"
    path.write_bytes(raw[:int(len(raw) * cut)])
    refused(cli("models", "check", str(path)), "cut.gguf")


# --- .bin pickles ---------------------------------------------------------------------------

class _Runs:
    """Unpickled, it would create the marker file (what a hostile pickle does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "code"])
def test_an_unreadable_or_hostile_bin_is_refused_by_name(base, tmp_path, monkeypatch, kind):
    import io

    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "unpickled"
    buffer = io.BytesIO()
    torch.save(weights(), buffer)
    content = {"truncated": buffer.getvalue()[:5000], "garbage": b"\x80\x04garbage" * 50,
               "empty": b"", "code": pickle.dumps({"w": _Runs(marker)})}[kind]
    folder = variant(base, tmp_path / "m", files={"pytorch_model.bin": content},
                     drop=["model.safetensors"])
    refused(run_on(folder, tmp_path), "pytorch_model.bin")
    assert not marker.exists()


# --- quantization_config ---------------------------------------------------------------------

@pytest.mark.parametrize("quantization", [
    {"quant_method": "gptq", "bits": "x"}, {"quant_method": "gptq", "bits": 4, "group_size": 0},
    {"quant_method": "gptq", "bits": 4, "group_size": True},
    {"quant_method": "awq", "bits": 4, "group_size": "128"}, {"quant_method": "nonsense"},
    {"quant_method": 5}, {"quant_method": "fp8", "weight_block_size": "x"},
    {"quant_method": "compressed-tensors", "config_groups": {"g": "x"}},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": -4}}}},
])
def test_a_bad_quantization_config_is_refused(base, tmp_path, quantization):
    folder = variant(base, tmp_path / "m", config={"quantization_config": quantization})
    refused(cli("models", "check", str(folder)))
    refused(run_on(folder, tmp_path), "quantization")
