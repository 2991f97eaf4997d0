"""LoRA adapters on tiny random models: greedy output under each adapter equals transformers +
peft, adapters and the base share steps, the prefix cache never shares a block across
adapters, and bad adapters are refused with their name and the reason."""

import json
import shutil

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.models.lora import LoraError
from batchrun.openai.params import check_model_field
from batchrun.openai.wire import RequestError
from tests.helpers import tiny_engine
from tests.lora_adapters import KINDS, make_adapter, make_adapters, reference
from tests.parity import assert_greedy_match

pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 99, 100, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46],
           [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]]
MAX_NEW = 12
# lora_B's scale (tests/lora_adapters.py) where PEFT's random init is too small to matter: the tiny
# Gemma 3 falls into repeating one token that an MLP-only adapter at scale 1 does not move.
SCALE_B = {"gemma3_text": 4.0}


def greedy(adapter=None, **kw):
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora=adapter, **kw)


def lora_engine(arch, tmp_path, **overrides):
    """(hf base, {name: (path, peft model)}, engine serving the adapters)."""
    (tmp_path / "base").mkdir()
    hf, _ = tiny_engine(arch, tmp_path / "base")
    adapters = make_adapters(hf, tmp_path, scale_b=SCALE_B.get(arch, 1.0))
    _, engine = tiny_engine(arch, tmp_path / "base",
                            lora={n: p for n, (p, _) in adapters.items()}, **overrides)
    return hf, adapters, engine


def record_steps(engine):
    """The set of slots each forward pass ran (spying on set_segments)."""
    steps = []
    real = engine.adapters.set_segments

    def spy(segments):
        if segments:
            steps.append({slot for _, _, slot in segments})
        real(segments)
    engine.adapters.set_segments = spy
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "tied", "gemma2", "gemma3_text", "phi3",
                                  "stablelm"])
def test_each_adapter_and_the_base_in_one_batch_match_peft(arch, tmp_path):
    hf, adapters, engine = lora_engine(arch, tmp_path)
    names = [None, *adapters]
    steps = record_steps(engine)
    jobs = [(p, name) for p in PROMPTS for name in names]
    outs = engine.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
    base_tokens = {}
    for (prompt, name), out in zip(jobs, outs):
        model = hf if name is None else adapters[name][1]
        ref, logits = reference(model, prompt, MAX_NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, f"{arch} {name}")
        if name is None:
            base_tokens[tuple(prompt)] = ref
        else:
            assert ref != base_tokens[tuple(prompt)], "the adapter changes nothing"
    assert max(len(s) for s in steps) == 3  # three adapters (and the base) in one step
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_attention_adapters_on_an_moe_model_match_peft(arch, tmp_path):
    """The native MoE paths take adapters on their attention projections (experts take none)."""
    (tmp_path / "base").mkdir()
    hf, _ = tiny_engine(arch, tmp_path / "base")
    (name, (path, peft_model)), = make_adapters(hf, tmp_path, kinds=KINDS[:1]).items()
    _, engine = tiny_engine(arch, tmp_path / "base", lora={name: path})
    outs = engine.generate(PROMPTS, greedy(name))
    for prompt, out in zip(PROMPTS, outs):
        ref, logits = reference(peft_model, prompt, MAX_NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, f"{arch} {name}")
        assert ref != reference(hf, prompt, MAX_NEW)[0], "the adapter changes nothing"


def test_more_adapters_than_slots_load_on_demand_and_evict_the_least_recent(tmp_path):
    hf, adapters, engine = lora_engine("llama", tmp_path, max_loras=2)
    manager = engine.adapters
    assert list(manager.resident) == ["tune0", "tune1"]
    steps = record_steps(engine)
    for name in ["tune2", "tune0", "tune1", "tune2"]:
        out = engine.generate([PROMPTS[0]], greedy(name))[0]
        ref, logits = reference(adapters[name][1], PROMPTS[0], MAX_NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, name)
    assert list(manager.resident) == ["tune1", "tune2"]
    # All of them in flight at once: never more than two adapters in a step.
    jobs = [(p, n) for p in PROMPTS for n in adapters]
    outs = engine.generate([p for p, _ in jobs], [greedy(n) for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs):
        ref, logits = reference(adapters[name][1], prompt, MAX_NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, name)
    assert max(len(s) for s in steps) <= 2


def test_the_same_prompt_under_two_adapters_never_shares_kv_blocks(tmp_path):
    hf, adapters, engine = lora_engine("llama", tmp_path, block_size=4)
    prompt = list(range(20, 45))  # six full blocks
    first = engine.generate([prompt], greedy("tune0"))[0]
    blocks_of_tune0 = set(engine.kv.cached[0].values())
    other = engine.generate([prompt], greedy("tune1"))[0]
    base = engine.generate([prompt], greedy(None))[0]
    again = engine.generate([prompt], greedy("tune0"))[0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 24  # its own blocks are still there
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    ref, logits = reference(adapters["tune1"][1], prompt, MAX_NEW)
    assert_greedy_match(other.outputs[0].token_ids, ref, logits, "tune1 after tune0")
    assert len(engine.kv.cached[0]) >= 3 * 6 and blocks_of_tune0 < set(engine.kv.cached[0].values())


def test_n_choices_and_scoring_run_on_the_adapter(tmp_path):
    hf, adapters, engine = lora_engine("llama", tmp_path)
    out = engine.generate([PROMPTS[1]], greedy("tune1", n=2))[0]
    ref, logits = reference(adapters["tune1"][1], PROMPTS[1], MAX_NEW)
    for choice in out.outputs:
        assert_greedy_match(choice.token_ids, ref, logits, "n=2")
    scored = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=0, prompt_logprobs=0,
                                                          lora="tune2"))[0]
    with torch.no_grad():
        lp = torch.log_softmax(adapters["tune2"][1](torch.tensor([PROMPTS[2]])).logits[0], -1)
    want = [float(lp[i, t]) for i, t in enumerate(PROMPTS[2][1:])]
    got = scored.prompt_logprobs.logprob[1:]
    assert got == pytest.approx(want, abs=1e-4)


def test_an_unknown_adapter_is_refused_by_the_engine(tmp_path):
    _, _, engine = lora_engine("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("r", PROMPTS[0], greedy("nope"))


# -- bad adapters ------------------------------------------------------------------------------

def _bad(kind, hf, path, tmp_path):
    if kind == "missing":
        return str(tmp_path / "nowhere")
    make_adapter(hf, path, 1, ["q_proj", "v_proj"], r=8)
    config = json.loads((path / "adapter_config.json").read_text())
    weights = path / "adapter_model.safetensors"
    if kind == "corrupt":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif kind == "no weights":
        weights.unlink()
    elif kind == "not json":
        (path / "adapter_config.json").write_text("{r: 8")
    elif kind in ("dora", "bias", "embed"):
        config.update({"dora": {"use_dora": True}, "bias": {"bias": "all"},
                       "embed": {"target_modules": ["q_proj", "embed_tokens"]}}[kind])
        (path / "adapter_config.json").write_text(json.dumps(config))
    elif kind == "other base":
        from tests.tiny_models import make_tiny

        other = make_tiny("llama", tmp_path / "wide", hidden_size=64, intermediate_size=128)
        shutil.rmtree(path)
        make_adapter(other, path, 1, ["q_proj", "v_proj"], r=8)
    return str(path)


@pytest.mark.parametrize("kind,words", [
    ("missing", "no such adapter folder"),
    ("corrupt", "truncated or corrupt"),
    ("no weights", "no adapter_model.safetensors"),
    ("not json", "is not JSON"),
    ("dora", "DoRA"),
    ("bias", "bias='all' is not supported"),
    ("embed", "embed_tokens are not supported"),
    ("other base", "has shape"),
    ("rank", "rank 8 is above --max-lora-rank 4"),
])
def test_a_bad_adapter_is_a_start_up_error_naming_it(kind, words, tmp_path):
    (tmp_path / "base").mkdir()
    hf, _ = tiny_engine("llama", tmp_path / "base")
    path = _bad(kind, hf, tmp_path / "bad", tmp_path)
    with pytest.raises(LoraError, match=words) as info:
        tiny_engine("llama", tmp_path / "base", lora={"broken": path},
                    max_lora_rank=4 if kind == "rank" else 64)
    assert "'broken'" in str(info.value)


def test_an_adapter_that_breaks_after_start_up_fails_only_its_requests(tmp_path):
    hf, adapters, engine = lora_engine("llama", tmp_path, max_loras=1)
    weights = tmp_path / "adapter2" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # tune2 is not resident: loaded on demand
    jobs = [(PROMPTS[0], "tune2"), (PROMPTS[1], "tune0"), (PROMPTS[2], None), (PROMPTS[0], "tune2")]
    outs = engine.generate([p for p, _ in jobs], [greedy(n) for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs):
        if name == "tune2":
            assert out.error and "'tune2'" in out.error and "corrupt" in out.error
            continue
        assert out.error is None
        model = hf if name is None else adapters[name][1]
        ref, logits = reference(model, prompt, MAX_NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, str(name))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_adapter_may_not_take_the_base_models_name(tmp_path):
    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import IdTokenizer, make_tiny
    from transformers import AutoConfig

    hf = make_tiny("llama", tmp_path / "base")
    path = tmp_path / "a"
    make_adapter(hf, path, 1, ["q_proj"])
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path / "base"))
    model = build_model(LlamaModel, cfg, tmp_path / "base", torch.device("cpu"), torch.float32)
    with pytest.raises(LoraError, match="base model's name"):
        build_engine(model, IdTokenizer(), EngineConfig.default(lora={"tiny": str(path)}), [2],
                     torch.device("cpu"), torch.float32, base_names=("tiny",))


# -- selection by the request's model field ----------------------------------------------------

def test_the_model_field_selects_an_adapter_the_base_or_nothing():
    adapters = ("tune0", "tune1")
    assert check_model_field("tune1", "smollm2-135m", (), False, adapters) == "tune1"
    assert check_model_field("smollm2-135m", "smollm2-135m", (), False, adapters) is None
    assert check_model_field(None, "smollm2-135m", (), False, adapters) is None
    assert check_model_field("tune0", "smollm2-135m", (), True, adapters) == "tune0"
    assert check_model_field("gpt-4o", "smollm2-135m", (), True, adapters) is None
    with pytest.raises(RequestError) as info:
        check_model_field("tune9", "smollm2-135m", (), False, adapters)
    assert info.value.code == "model_not_found" and "'tune9'" in info.value.message
    assert "'tune0', 'tune1'" in info.value.message


def test_lora_options_from_the_command_line_and_a_job_spec(tmp_path):
    from batchrun.options.engine import EngineConfig
    from batchrun.options.fields import OptionsError, validate
    from batchrun.options.run import from_cli

    cfg = from_cli(EngineConfig, {"lora": {"a": "/x", "b": "s3://bucket/b"}, "max_loras": 2,
                                  "max_lora_rank": 16})
    assert cfg.lora.adapters == {"a": "/x", "b": "s3://bucket/b"} and cfg.lora.max_loras == 2
    assert validate(EngineConfig, {"lora": {"a": "/x"}}).lora.max_lora_rank == 64
    with pytest.raises(OptionsError, match="max_loras"):
        validate(EngineConfig, {"max_loras": 0})


def test_a_job_spec_names_adapters_relative_to_its_folder(tmp_path):
    from batchrun.batch.shell.jobspec import load

    (tmp_path / "job.toml").write_text(
        'input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nmax_loras = 2\n'
        '[engine.lora]\nsupport = "adapters/support"\nlegal = "s3://bucket/legal"\n')
    opts = load(str(tmp_path / "job.toml"))
    assert opts.engine.lora.adapters == {"support": str(tmp_path / "adapters" / "support"),
                                         "legal": "s3://bucket/legal"}
    assert opts.engine.lora.max_loras == 2


def test_a_sweep_runs_adapters_on_the_grids_one_base_model():
    from batchrun.sweep.requests import ModelRequests
    from batchrun.sweep.run import lora_bases
    from batchrun.sweep.spec import SpecError

    adapters = {"support": "/a", "legal": "/b"}
    assert lora_bases(["smollm2-135m", "support", "legal"], adapters) == {
        "smollm2-135m": "smollm2-135m", "support": "smollm2-135m", "legal": "smollm2-135m"}
    assert lora_bases(["support"], adapters) == {"support": "smollm2-135m"}
    assert lora_bases(["m1", "m2"], adapters) == {"m1": "m1", "m2": "m2"}
    with pytest.raises(SpecError, match="several base models"):
        lora_bases(["m1", "m2", "legal"], adapters)
    reqs = ModelRequests(model="legal")
    reqs.add("c1/1", "/v1/chat/completions", {"messages": []})
    assert json.loads(reqs.lines[0])["body"]["model"] == "legal"
