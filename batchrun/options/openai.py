"""Options of the OpenAI adapter (how requests become prompts and outputs become responses) and
the request defaults the user gives for fields a request leaves out."""

from __future__ import annotations

import ipaddress
import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from batchrun.options.fields import option

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
# The parsers batchrun.openai.parsers registers (it checks, on import, that they are these).
# Aliases included (batchrun.openai.parsers.ALIASES: vLLM's names and short forms).
ToolParserName = Literal["harmony", "hermes", "llama3", "llama3_json", "llama4_json", "mistral",
                         "openai", "qwen"]
ReasoningParserName = Literal["deepseek_r1", "harmony", "mimo", "openai_gptoss", "qwen3", "think"]
# How /v1/embeddings pools the final hidden states (batchrun.engine.pooling).
PoolingName = Literal["last", "mean", "cls"]
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
                        r"(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*\.?$")


class RequestDefaults(BaseModel):
    """Job spec table [defaults]."""

    model_config = _STRICT
    SECTION: ClassVar[str] = "sampling defaults"

    temperature: float | None = option(None, "Temperature for requests that leave it out.",
                                       ge=0, le=2)
    max_tokens: int | None = option(None, "max_tokens for requests that leave it out [default: "
                                    "fill the context].", ge=1)
    seed: int | None = option(None, "seed for requests that leave it out: sampled outputs that "
                              "a rerun reproduces.", ge=-(2**63), le=2**63 - 1)


class OpenAIOptions(BaseModel):
    model_config = _STRICT
    SECTION: ClassVar[str] = "model"
    IMAGES: ClassVar[str] = "input and output"  # where image parts may come from, how big

    ignore_model_field: bool = option(False, "Run every request on the loaded model whatever its "
                                      "`model` field says. For files written for another provider "
                                      "or model.")
    chat_template: str | None = option(
        None, "A Jinja chat template file overriding the model's. For example one that renders "
        "tools: batchrun/openai/templates/chatml_tools.jinja.", metavar="FILE")
    tool_parser: ToolParserName | None = option(
        None, "How tool calls are read from the output [default: from the chat template]. hermes "
        "(alias qwen), llama3_json (aliases llama3, llama4_json), mistral, harmony (alias openai: "
        "GPT-OSS's channels, which also give reasoning_content); a gpt_oss model gets harmony.")
    reasoning_parser: ReasoningParserName | None = option(
        None, "Move <think>...</think> into message.reasoning_content [default: off]. qwen3 (alias "
        "mimo), deepseek_r1 (the thought opened in the prompt), think; harmony (alias "
        "openai_gptoss) is the Harmony tool parser, which splits GPT-OSS's reasoning itself (a "
        "gpt_oss model's default).")
    pooling: PoolingName | None = option(
        None, "How /v1/embeddings pools the final hidden states: last, mean or cls token. Default: "
        "the model folder's sentence-transformers config (modules.json, 1_Pooling/config.json), "
        "else last.")
    normalize: bool | None = option(
        None, "Scale embeddings to unit length; --no-normalize keeps the raw pooled vector. "
        "Default: the sentence-transformers config's Normalize module when it has one, else "
        "normalize.")
    # Rerankers that are causal LMs or need their pair in a prompt (/v1/score, /v1/rerank).
    score_tokens: str | None = option(
        None, "Read a causal LM as a reranker from the logits of these comma-separated tokens. At "
        "the last position: `no,yes` scores a pair by the softmax of the two at `yes` "
        "(Qwen3-Reranker), one token by the sigmoid of its logit; /v1/classify gives them as "
        "labels.", metavar="TOKENS")
    score_template: str | None = option(
        None, "A Jinja template (file or text) rendering /v1/score and /v1/rerank pairs. Default: "
        "the tokenizer's pair encoding. The pair is rendered as a chat whose messages have the "
        "roles `query` and `document` (vLLM's score templates; e.g. "
        "batchrun/openai/templates/qwen3_reranker.jinja).", metavar="FILE")
    # Images in requests (vision-language models): where they may come from and how big.
    allowed_media_path: str | None = option(
        None, "A directory under which image parts may name local files [default: none]. A part "
        "names one by its path or a file:// URL.", metavar="DIR", section=IMAGES)
    allow_media_host: list[str] = option(
        list, "Fetch image URLs from this host or network even though it is not public. HOST|CIDR: "
        "a host name, an address or a network; loopback, private, link-local and other non-public "
        "addresses are refused by default. Repeatable.", metavar="HOST|CIDR", section=IMAGES)
    limit_images_per_prompt: int = option(16, "Images one request may carry.", ge=0,
                                          section=IMAGES)
    media_max_bytes: int = option(20 << 20, "Bytes one image file may have.", ge=1,
                                  section=IMAGES)
    media_max_pixels: int = option(
        40_000_000, "Pixels (width x height) one image may decode to. A larger one (a "
        "decompression bomb) is that line's error.", ge=1, section=IMAGES)
    media_fetch_timeout: float = option(10.0, "Seconds one image fetch may take, per attempt.",
                                        gt=0, section=IMAGES)
    media_fetch_retries: int = option(
        2, "Retries of an image fetch after a transient error, with backoff. Transient: a "
        "connection error, a timeout, HTTP 429 or 5xx.", ge=0, section=IMAGES)
    media_fetch_workers: int = option(8, "Threads fetching and decoding images ahead of the "
                                      "engine.", ge=1, section=IMAGES)

    @field_validator("allow_media_host", mode="before")
    @classmethod
    def _media_hosts(cls, value: object) -> object:
        """A host name or a network, each entry checked (a list, a tuple or one string)."""
        entries = [value] if isinstance(value, str) else value
        if not isinstance(entries, (list, tuple)):
            return value
        out = []
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(f"{entry!r} is not a host name or a network")
            entry = entry.strip().lower()
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                if not _HOST_NAME.match(entry):
                    raise ValueError(f"{entry!r} is neither a host name nor an address or "
                                     "network (CIDR)") from None
            out.append(entry)
        return out
