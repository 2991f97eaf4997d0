"""Chat request -> engine SamplingParams, and the checks an API answers with 400 before generating."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from batchrun.engine.sampling_params import SamplingParams
from batchrun.openai.protocol import ChatCompletionRequest, RequestError

# What OpenAI uses when neither the request, the user nor the model says otherwise.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


@dataclass(frozen=True)
class RequestDefaults:
    """Defaults the user gives for fields a request leaves out (`--temperature`, `--max-tokens`)."""

    temperature: float | None = None
    max_tokens: int | None = None


def check_model_field(requested: str | None, name: str, aliases: Sequence[str] = (),
                      ignore: bool = False) -> None:
    if ignore or requested in (None, "", "default", name) or requested in aliases:
        return
    raise RequestError(
        f"model: the model {requested!r} is not loaded; this run serves {name!r} "
        "(omit the field, use \"default\", or pass --ignore-model-field for files written for "
        "another provider)", code="model_not_found", param="model", status_code=404)


def _pick(name: str, request: ChatCompletionRequest, *layers: Mapping[str, Any]) -> Any:
    value = getattr(request, name, None)
    for layer in layers:
        if value is not None:
            break
        value = layer.get(name)
    return value


def to_sampling_params(request: ChatCompletionRequest, prompt_len: int, max_model_len: int,
                       generation_defaults: Mapping[str, Any] | None = None,
                       defaults: RequestDefaults = RequestDefaults()) -> SamplingParams:
    """Each field from the request, else the user's defaults, else the model's
    generation_config, else OpenAI's defaults.

    The user's command-line defaults come before the model's: someone who types
    `--temperature 0` means it for this run.
    """
    if request.n is not None and request.n > 1:
        raise RequestError("n: only n=1 is supported for now", code="unsupported_value", param="n")
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"messages resulted in {prompt_len} tokens, leaving no room for a completion. Please "
            "reduce the length of the messages.", code="context_length_exceeded", param="messages")

    model = dict(generation_defaults or {})
    user = {k: v for k, v in vars(defaults).items() if v is not None}

    explicit = request.max_completion_tokens or request.max_tokens
    if explicit is not None:
        if prompt_len + explicit > max_model_len:
            param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + explicit} tokens ({prompt_len} in the messages, "
                f"{explicit} in the completion). Please reduce the length of the messages or "
                "completion.", code="context_length_exceeded", param=param)
        max_tokens = explicit
    else:
        # A default that does not fit is trimmed to the room left, not an error.
        default = user.get("max_tokens") or model.get("max_tokens")
        max_tokens = min(default, room) if default else room

    stop = request.stop if isinstance(request.stop, list) else [request.stop] if request.stop else []
    params = SamplingParams(
        temperature=float(_pick("temperature", request, user, model, OPENAI_DEFAULTS)),
        top_p=float(_pick("top_p", request, user, model, OPENAI_DEFAULTS)),
        max_tokens=max_tokens,
        stop=list(stop),
        seed=request.seed,
    )
    for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _pick(name, request, user, model)
        if value is not None:
            setattr(params, name, value)
    if params.top_k == -1:  # vLLM's spelling of "off"
        params.top_k = 0
    return params
