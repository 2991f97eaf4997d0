"""A GPT-OSS stand-in tokenizer without the hub: the bundled SmolLM2 tokenizer with Harmony's
special tokens added, and a reduced Harmony chat template written after GPT-OSS's: its system
message with the `reasoning_effort` variable, its developer message (the first system /
developer message as instructions, then the tools), and its message loop as the real one
behaves: an assistant turn that made a call writes its thought (`thinking`, else `content`;
both is an error) on the analysis channel unless a later assistant turn answered, then its
first call only; a tool result is addressed from the latest call's name, its content as JSON;
earlier answers go on the final channel without their thought. (Its tool signatures are
simplified, and it has no date line.)"""

from __future__ import annotations

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]

TEMPLATE = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- if messages[0].role in ('system', 'developer') %}
{%- set instructions = messages[0].content %}{% set turns = messages[1:] %}
{%- else %}{% set instructions = '' %}{% set turns = messages %}{% endif %}
{%- if instructions or tools %}<|start|>developer<|message|>
{%- if instructions %}{{ '# Instructions\n\n' + instructions + '\n\n' }}{% endif %}
{%- if tools %}# Tools

## functions

namespace functions {
{%- for tool in tools %}
// {{ tool.function.description | default('') }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- set latest = namespace(call=none) %}
{%- for message in turns %}
{%- if message.role == 'assistant' %}
{%- for field in ('content', 'thinking') %}
{%- if field in message and ('<|channel|>analysis<|message|>' in message[field] or
                              '<|channel|>final<|message|>' in message[field]) %}
{{- raise_exception('channel tags in the ' + field + ' field') }}
{%- endif %}
{%- endfor %}
{%- if 'tool_calls' in message %}
{%- set answered = namespace(yes=false) %}
{%- for later in turns[loop.index:] %}
{%- if later.role == 'assistant' and 'tool_calls' not in later %}{% set answered.yes = true %}{% endif %}
{%- endfor %}
{%- set call = message.tool_calls[0] %}
{%- if call.function %}{% set call = call.function %}{% endif %}
{%- if message.content and message.thinking %}
{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls') }}
{%- elif message.content and not answered.yes %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}
{%- elif message.thinking and not answered.yes %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
{%- endif %}
{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary ' }}
{{- (call.content_type if call.content_type is defined else 'json') + '<|message|>' }}
{{- call.arguments | tojson }}<|call|>
{%- set latest.call = call.name %}
{%- elif loop.last and not add_generation_prompt %}
{%- if 'thinking' in message %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
{%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}
{%- else %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
{%- set latest.call = none %}
{%- endif %}
{%- elif message.role == 'tool' %}
{%- if latest.call is none %}{{ raise_exception('a tool result with no call before it') }}{% endif %}
{{- '<|start|>functions.' + latest.call + ' to=assistant<|channel|>commentary<|message|>' }}
{{- message.content | tojson + '<|end|>' }}
{%- elif message.role == 'user' %}
{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
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
