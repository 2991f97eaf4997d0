"""LoRA on the transformers backend: adapters made with peft on tiny random models of
architectures only the backend runs, each on its own module names (GPT-NeoX's query_key_value,
Phi-3's fused qkv_proj and gate_up_proj, Gemma 2's q/k/v/o), give the greedy tokens and logprobs
of peft's model through one batch mixing the base model and two adapters; a target the backend
cannot wrap is refused naming the adapter and the module."""

import json
from dataclasses import replace

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, check_adapters, load_weights
from batchrun.models.lora import LoraError
from batchrun.options.engine import EngineConfig
from tests.lora_adapters import make_adapter, make_adapters
from tests.parity import ParityReport
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_lora import record_steps
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

pytest.importorskip("peft")
CPU = torch.device("cpu")
# arch -> the two adapters' (targets, rank, alpha, use_rslora), by the architecture's own names.
ADAPTERS = {
    "gemma2": [(["q_proj", "v_proj"], 4, 16, False),
               (["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, 16, True)],
    "gpt_neox": [(["query_key_value"], 4, 16, False),
                 (["dense", "dense_h_to_4h", "dense_4h_to_h"], 8, 16, True)],
    "phi3": [(["qkv_proj", "o_proj"], 4, 16, False), (["gate_up_proj", "down_proj"], 6, 12, False)],
}


def lora_backend_engine(arch, tmp_path, adapters, **overrides):
    """The engine on the transformers backend over `arch`'s tiny checkpoint in tmp_path/base,
    serving `adapters` ({name: folder})."""
    overrides.setdefault("block_size", 4)
    config = EngineConfig.default(model_impl="transformers", lora=adapters, **overrides)
    check_adapters(config.lora, ("tiny",))
    model = load_weights(tmp_path / "base", config, CPU, torch.float32)
    return build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_base_and_two_adapters_in_one_batch_match_peft(arch, tmp_path):
    hf = make_tiny(arch, tmp_path / "base", archs=BACKEND_ARCHS)
    adapters = make_adapters(hf, tmp_path, ADAPTERS[arch])
    engine = lora_backend_engine(arch, tmp_path, {n: p for n, (p, _) in adapters.items()},
                                 max_num_batched_tokens=24)
    wrapped = [n for n, m in engine.runner.model.named_modules() if type(m).__name__ == "LoraLinear"]
    assert wrapped, "no projection was wrapped"
    steps = record_steps(engine)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 19, 11)]
    jobs = [(p, name) for p in prompts for name in (None, *adapters)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = engine.generate([p for p, _ in jobs], [replace(params, lora=name) for _, name in jobs])
    report = ParityReport()
    tokens = {}
    for (prompt, name), out in zip(jobs, outs):
        model = hf if name is None else adapters[name][1]
        check_against_transformers(model, [prompt], [out], f"{arch} {name}", report)
        tokens[(tuple(prompt), name)] = out.outputs[0].token_ids
    for prompt in prompts:
        for name in adapters:
            assert tokens[(tuple(prompt), name)] != tokens[(tuple(prompt), None)], \
                f"{arch}: adapter {name} changes nothing"
    assert report.compared == len(jobs)
    assert max(len(s) for s in steps) == 2  # both adapters (and the base) in one step
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def _edited(hf, path, targets, extra):
    """A peft adapter of `hf` on `targets`, its config then naming `extra` as well."""
    make_adapter(hf, path, 1, targets)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"]) + [extra]
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("arch,extra,words", [
    ("mixtral", "experts", r"'experts': model\.layers\.0\.mlp\.experts is a MixtralExperts, not a "
                           r"plain linear; LoRA applies only to the plain linears of the decoder "
                           r"layers: q_proj, k_proj, v_proj, o_proj"),
    ("gpt_neox", "embed_in", r"'embed_in': gpt_neox\.embed_in is outside the decoder layers "
                             r"\(gpt_neox\.layers\)"),
    ("gemma2", "c_attn", r"target module\(s\) c_attn are not supported"),
])
def test_a_target_the_backend_cannot_wrap_is_refused_naming_it(arch, extra, words, tmp_path):
    hf = make_tiny(arch, tmp_path / "base", archs=BACKEND_ARCHS)
    target = "query_key_value" if arch == "gpt_neox" else "q_proj"
    path = _edited(hf, tmp_path / "bad", [target], extra)
    with pytest.raises(LoraError, match=words) as info:
        lora_backend_engine(arch, tmp_path, {"broken": path})
    assert "'broken'" in str(info.value)


def test_an_adapter_of_the_native_layout_is_checked_against_the_backends_shapes(tmp_path):
    """A Llama adapter on a GPT-NeoX base names modules the base does not have."""
    make_tiny("gpt_neox", tmp_path / "base", archs=BACKEND_ARCHS)
    llama = make_tiny("llama", tmp_path / "llama")
    make_adapter(llama, tmp_path / "bad", 1, ["q_proj"])
    with pytest.raises(LoraError, match="target module\\(s\\) q_proj are not supported") as info:
        lora_backend_engine("gpt_neox", tmp_path, {"other": str(tmp_path / "bad")})
    assert "query_key_value, dense, dense_h_to_4h, dense_4h_to_h" in str(info.value)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_an_adapter_on_a_vision_language_models_decoder_matches_peft(family, tmp_path,
                                                                     smol_tokenizer):
    """The adapter targets the language model only (a regex over full module names); a line
    with an image under the adapter and one under the base share the engine. An adapter that
    also targets the vision tower is refused: LoRA runs in the decoder layers only."""
    from batchrun.llm import load_from_path
    from batchrun.models.transformers.processor import render
    from tests.tiny_vlms import image, make_tiny_vlm
    from tests.unit.test_vision_language import chat, reference

    hf, _ = make_tiny_vlm(family, tmp_path / "base", smol_tokenizer)
    tuned = make_adapter(hf, tmp_path / "tune", 7, r".*language_model.*\.(q_proj|v_proj|down_proj)",
                         r=8, scale_b=4.0)
    config = EngineConfig.default(block_size=4, max_num_batched_tokens=16, num_blocks=256,
                                  threads=1, lora={"tune": str(tmp_path / "tune")})
    loaded = load_from_path(tmp_path / "base", config)
    torch.set_num_threads(1)
    images = [image(120, 90, 1)]
    prompt, mm = render(loaded.processor, chat(1), images)
    engine = loaded.engine
    for rid, lora in (("tune", "tune"), ("base", None)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, lora=lora),
                           multimodal=mm)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    want = {"tune": reference(tuned, loaded.processor, chat(1), images),
            "base": reference(hf, loaded.processor, chat(1), images)}
    assert want["tune"] != want["base"], "the adapter changes nothing"
    assert done == want
    if family == "llava":  # its CLIP vision tower names its projections q_proj too
        make_adapter(hf, tmp_path / "both", 8, ["q_proj"])
        with pytest.raises(LoraError, match=r"vision_tower\.\S+\.q_proj is outside the decoder "
                                            r"layers \(model\.language_model\.layers\)"):
            load_from_path(tmp_path / "base", config.model_copy(update={
                "lora": config.lora.model_copy(update={"adapters": {"both": str(tmp_path / "both")}})}))
