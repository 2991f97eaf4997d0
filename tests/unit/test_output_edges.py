"""Outputs that are what they claim: numeric edges of the sampling fields (a tiny temperature is
greedy, a penalty the sampler cannot represent is a 400), a schema the grammar cannot enforce
is a 400 naming the field, a choice whose grammar is incomplete does not finish "stop", and
weights with NaN or inf are refused at load (adapters and the base model)."""

from __future__ import annotations


import pytest
import torch

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.openai.params import GREEDY_BELOW
from batchrun.openai.wire import RequestError
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.served_model import TokenizerModel

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def serving(smol_tokenizer):
    model = TokenizerModel(smol_tokenizer, "smollm2-135m", max_model_len=2048)
    return OpenAIServing(model, ServingOptions.of(OpenAIOptions()))


def chat(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}


def json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def refused(serving, url, body) -> RequestError:
    with pytest.raises(RequestError) as info:
        serving.prepare(url, body)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize("value, sent", [(1e-38, 0.0), (1e-300, 0.0), (5e-324, 0.0),
                                         (GREEDY_BELOW / 2, 0.0), (GREEDY_BELOW, GREEDY_BELOW),
                                         (0.7, 0.7), (0, 0.0)])
def test_a_tiny_temperature_is_greedy(serving, value, sent):
    assert serving.prepare(CHAT, chat(temperature=value)).params.temperature == sent


def test_a_tiny_default_temperature_is_greedy_too(smol_tokenizer):
    model = TokenizerModel(smol_tokenizer, "m", max_model_len=2048,
                           generation_defaults={"temperature": 1e-40})
    from_model = OpenAIServing(model, ServingOptions.of(OpenAIOptions()))
    assert from_model.prepare(CHAT, chat()).params.temperature == 0.0
    from_user = OpenAIServing(model, ServingOptions.of(
        OpenAIOptions(), RequestDefaults(temperature=1e-39)))
    assert from_user.prepare(CHAT, chat()).params.temperature == 0.0


@pytest.mark.parametrize("value", [1e-300, 0.0099, 0, -1, 2.5, float("nan"), float("inf")])
def test_a_repetition_penalty_the_sampler_cannot_represent_is_a_400(serving, value):
    err = refused(serving, CHAT, chat(repetition_penalty=value))
    assert err.param == "repetition_penalty", err.message


def test_repetition_penalties_in_range_reach_the_sampler(serving):
    for value in (0.01, 1.0, 2.0):
        assert serving.prepare(CHAT, chat(repetition_penalty=value)).params \
            .repetition_penalty == value


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_a_schema_no_output_can_satisfy_is_a_400_naming_it(serving, url):
    body = chat(response_format=json_schema({"$ref": "#"}))
    if url == COMPLETIONS:
        body = {"prompt": "Hi", "max_tokens": 8, "response_format": body["response_format"]}
    err = refused(serving, url, body)
    assert err.param == "response_format.json_schema.schema", err.message
    assert "admits no output" in err.message


def test_recursive_schemas_that_have_values_are_accepted(serving):
    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array",
                                                          "items": {"$ref": "#"}}},
            "required": ["name"]}
    assert serving.prepare(CHAT, chat(response_format=json_schema(tree))).params.grammar
    assert serving.prepare(CHAT, chat(response_format=json_schema(SCHEMA))).params.grammar


def _finished(prepared, text, tokenizer, *, eos=True, stop_reason=None):
    ids = tokenizer.encode(text, add_special_tokens=False) + \
        ([tokenizer.eos_token_id] if eos else [])
    choice = CompletionOutput(0, text, ids, "stop", stop_reason=stop_reason)
    return RequestOutput("r", [1, 2], [choice], finished=True)


@pytest.mark.parametrize("text, finish", [('{"a": 12}', "stop"), ('{"a": 1', "length"),
                                          ('{"a"', "length"), ("", "length")])
def test_a_choice_whose_grammar_is_incomplete_does_not_finish_stop(serving, smol_tokenizer,
                                                                   text, finish):
    prepared = serving.prepare(CHAT, chat(response_format=json_schema(SCHEMA)))
    body = prepared.finalize(_finished(prepared, text, smol_tokenizer))
    assert body["choices"][0]["finish_reason"] == finish
    # streamed the same
    chunks = prepared.chunks()
    chunks.start()
    sent = chunks.update(_finished(prepared, text, smol_tokenizer))
    reasons = [c["choices"][0]["finish_reason"] for c in sent if c.get("choices")]
    assert reasons[-1] == finish


def test_a_stop_sequence_or_no_grammar_keeps_stop(serving, smol_tokenizer):
    prepared = serving.prepare(CHAT, chat(response_format=json_schema(SCHEMA)))
    asked = _finished(prepared, '{"a": 1', smol_tokenizer, eos=False, stop_reason="}")
    assert prepared.finalize(asked)["choices"][0]["finish_reason"] == "stop"
    free = serving.prepare(CHAT, chat())
    assert free.grammar_complete is None
    assert free.finalize(_finished(free, "Hi", smol_tokenizer))["choices"][0][
        "finish_reason"] == "stop"


def test_an_answer_of_only_eos_has_empty_content_not_null(serving, smol_tokenizer):
    """logit_bias forcing EOS: the choice finishes at once with content "" (OpenAI's answer),
    in the body and in the stream."""
    prepared = serving.prepare(CHAT, chat(logit_bias={str(smol_tokenizer.eos_token_id): 100}))
    assert prepared.params.logit_bias == {smol_tokenizer.eos_token_id: 100}
    message = prepared.finalize(_finished(prepared, "", smol_tokenizer))["choices"][0]["message"]
    assert message["content"] == ""
    chunks = prepared.chunks()
    chunks.start()
    sent = chunks.update(_finished(prepared, "", smol_tokenizer))
    assert all(c["choices"][0]["delta"].get("content") in (None, "")
               for c in sent if c.get("choices"))


# --- non-finite weights ---------------------------------------------------------------------

def _poison(file, key_part: str, value: float) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    key = next(k for k in tensors if key_part in k)
    tensors[key].view(-1)[0] = value
    save_file(tensors, file)
    return key


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_base_model_with_non_finite_weights_is_refused_naming_the_weight(tmp_path, value):
    from transformers import AutoConfig

    from batchrun.llm import build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    build_model(LlamaModel, cfg, tmp_path, torch.device("cpu"), torch.float32)  # as made: fine
    key = _poison(next(tmp_path.glob("*.safetensors")), "o_proj", value)
    with pytest.raises(ValueError, match=f"{key}.*non-finite"):
        build_model(LlamaModel, cfg, tmp_path, torch.device("cpu"), torch.float32)


def test_a_lora_adapter_with_nan_weights_is_refused_at_load(tmp_path):
    pytest.importorskip("peft")
    from batchrun.models.lora import LoraError
    from tests.helpers import tiny_engine
    from tests.lora_adapters import make_adapter

    (tmp_path / "base").mkdir()
    hf, _ = tiny_engine("llama", tmp_path / "base")
    path, fine = tmp_path / "nan", tmp_path / "fine"
    make_adapter(hf, path, 1, ["q_proj", "v_proj"], r=8)
    make_adapter(hf, fine, 2, ["q_proj", "v_proj"], r=8)
    key = _poison(path / "adapter_model.safetensors", "lora_B", float("nan"))
    with pytest.raises(LoraError, match="non-finite") as info:  # resident: loaded at start
        tiny_engine("llama", tmp_path / "base", lora={"poisoned": str(path)})
    assert "'poisoned'" in str(info.value) and key in str(info.value)
    # loaded on demand (not resident at start): its requests fail, naming it, the rest run
    from batchrun.engine import SamplingParams

    _, engine = tiny_engine("llama", tmp_path / "base",
                            lora={"fine": str(fine), "poisoned": str(path)}, max_loras=1)

    outs = engine.generate([[5, 6, 7], [5, 6, 7]], [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, lora=name)
        for name in ("poisoned", "fine")])
    assert outs[0].error and "'poisoned'" in outs[0].error and "non-finite" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3



# --- the edges the validation lets through, through the real sampler -------------------------

@pytest.mark.parametrize("fields", [
    {"temperature": 1e-38}, {"temperature": GREEDY_BELOW}, {"temperature": 2, "top_p": 1e-300},
    {"repetition_penalty": 0.01, "temperature": 0}, {"repetition_penalty": 0.01},
    {"presence_penalty": 2, "frequency_penalty": -2, "logit_bias": {"5": 100, "6": -100}},
    {"min_p": 1.0, "top_k": 2 ** 31 - 1},
])
def test_every_accepted_edge_samples_a_real_token(serving, fields):
    from dataclasses import dataclass, field as default

    from batchrun.engine.sampler import Sampler

    @dataclass
    class Row:
        params: object
        all_token_ids: list = default(default_factory=lambda: [5, 6, 7, 5])
        num_prompt_tokens: int = 2
        request_id: str = "r"

        @property
        def num_output_tokens(self):
            return len(self.all_token_ids) - self.num_prompt_tokens

    params = serving.prepare(CHAT, chat(**fields)).params
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 40  # big logits
    tokens = Sampler(torch.device("cpu"), None, [2])(logits, [Row(params)] * 3).token_ids
    assert all(0 <= t < vocab for t in tokens), tokens
    if params.temperature == 0 and params.repetition_penalty == 1.0:
        assert tokens == logits.argmax(dim=-1).tolist()
