"""batchrun's own tokenizer (tokenizers + Jinja, models/text/tokenizer.py) against transformers'
AutoTokenizer on the bundled model's folder: the same ids, text and rendered chat templates."""

from pathlib import Path

import pytest

from batchrun.models.text.tokenizer import Tokenizer, load_tokenizer, plain_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOOLS_TEMPLATE = (ROOT / "batchrun/openai/templates/chatml_tools.jinja").read_text()
# Qwen3-style: reasoning_content, enable_thinking, namespace, loop controls, special tokens.
REASONING_TEMPLATE = """{{ bos_token }}{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}
<|im_start|>assistant
<think>
{{ m.reasoning_content | trim }}
</think>
{{ m.content }}<|im_end|>
{%- elif m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}
{%- else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{%- endif %}
{%- if loop.index0 > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{%- endif %}{{ eos_token if false else '' }}"""
PARTS_TEMPLATE = ("{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}|"
                  "{% endfor %}{% endgeneration %}{% endfor %}{{ 'x' | tojson }}{{ {'a': '<b>'} | tojson }}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city; uses 'quotes' & <tags>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TEXTS = ["Hello, world!", "  leading spaces and trailing  ", "déjà vu — ünïcödé 日本語 🙂",
         "def f(x):\n    return x ** 2\n\n\n", "<|im_start|>user\nhi<|im_end|>", "can't won't I'm",
         "tabs\tand\r\nnewlines", "", "a" * 300, "1234567890 3.14159 -42"]


@pytest.fixture(scope="module")
def folder():
    from batchrun.models.weights.resolve import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="module")
def ours(folder):
    tok = plain_tokenizer(folder)
    assert isinstance(tok, Tokenizer)  # the bundled model takes the fast path
    return tok


@pytest.fixture(scope="module")
def theirs(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_encode_decode_and_special_tokens_match(ours, theirs):
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special), text
            assert ours(text)["input_ids"] == theirs(text)["input_ids"]
        ids = theirs.encode(text, add_special_tokens=False) + [2, 1, 0]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.decode(2) == theirs.decode(2)
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert ours.chat_template == theirs.chat_template
    assert len(ours) == len(theirs)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again <|im_end|>"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "22 C", "tool_call_id": "c1"}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": " add them \n"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn "}],
]


@pytest.mark.parametrize("template", [None, TOOLS_TEMPLATE, REASONING_TEMPLATE],
                         ids=["model", "tools", "reasoning"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_templates_render_and_tokenize_the_same(ours, theirs, template, conversation):
    messages = CONVERSATIONS[conversation]
    cases = [dict(add_generation_prompt=True), dict(add_generation_prompt=False)]
    if template is TOOLS_TEMPLATE:
        cases.append(dict(add_generation_prompt=True, tools=TOOLS))
    if template is REASONING_TEMPLATE:
        cases.append(dict(add_generation_prompt=True, enable_thinking=False))
    if messages[-1]["role"] == "assistant" and messages[-1]["content"]:
        cases.append(dict(continue_final_message=True))
    for kwargs in cases:
        outcome = []
        for tok in (ours, theirs):
            try:
                text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                               **kwargs)
                ids = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                              return_dict=True, **kwargs)["input_ids"]
                outcome.append((text, list(ids)))
            except Exception as exc:  # both must refuse the same conversations
                outcome.append(type(exc).__name__ == "TemplateError" or "error")
        assert outcome[0] == outcome[1], kwargs


def test_content_parts_generation_tags_and_tojson(ours, theirs):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, tokenize=False) == \
        theirs.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, tokenize=False)


def test_template_errors_are_raised(ours):
    with pytest.raises(Exception, match="bad role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}],
                                 chat_template=REASONING_TEMPLATE, tokenize=False)


def test_folders_it_cannot_promise_go_to_transformers(tmp_path, folder):
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    assert plain_tokenizer(tmp_path) is not None
    config = (tmp_path / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text(
        config.replace('"TokenizersBackend"', '"LlamaTokenizer"'))
    assert plain_tokenizer(tmp_path) is None
    assert not isinstance(load_tokenizer(tmp_path), Tokenizer)
