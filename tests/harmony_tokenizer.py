"""A GPT-OSS stand-in tokenizer without the hub: the bundled SmolLM2 tokenizer with Harmony's
special tokens added, and a small Harmony chat template (the real one's system / developer /
generation-prompt shape, and its `reasoning_effort` variable)."""

from __future__ import annotations

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]

TEMPLATE = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{%- for tool in tools %}
// {{ tool.function.description | default('') }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|start|>functions.{{ message.name | default('tool') }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def harmony_tokenizer(smol_tokenizer):
    """A copy of the session's SmolLM2 tokenizer (the `smol_tokenizer` fixture, left as it is)
    with the Harmony tokens and template."""
    import copy

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def eos_ids(tokenizer) -> list[int]:
    """generation_config.json's eos_token_id as GPT-OSS ships it: <|return|>, <|endoftext|>,
    <|call|>."""
    ids = tokenizer.convert_tokens_to_ids
    return [ids("<|return|>"), ids("<|endoftext|>"), ids("<|call|>")]
