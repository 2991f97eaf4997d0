"""Request -> engine SamplingParams, and the checks an API answers with 400 before generating."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from batchrun.engine.sampling_params import GrammarSpec, SamplingParams
from batchrun.openai.wire import RequestError
from batchrun.openai.requests import ChatCompletionRequest, CompletionRequest
from batchrun.options.lora import RESERVED_NAMES
from batchrun.options.openai import RequestDefaults

# What OpenAI uses when neither the request, the user nor the model says otherwise.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}
# /v1/completions (the legacy endpoint) generates 16 tokens unless told otherwise.
COMPLETIONS_MAX_TOKENS = 16
# A temperature below this is greedy, as in vLLM (_SAMPLING_EPS): dividing logits by 1e-38
# overflows float32 and leaves nothing to sample.
GREEDY_BELOW = 1e-5


def check_model_field(requested: str | None, name: str, aliases: Sequence[str] = (),
                      ignore: bool = False, adapters: Sequence[str] = ()) -> str | None:
    """The LoRA adapter a request's `model` names, None for the base model; RequestError for a
    model this run does not serve (with `ignore`, anything but an adapter is the base)."""
    if requested is not None and requested in adapters:
        return requested
    if ignore or requested in (None, "", *RESERVED_NAMES, name) or requested in aliases:
        return None
    served = f"{name!r}" + (f" and its LoRA adapters {', '.join(map(repr, adapters))}"
                            if adapters else "")
    raise RequestError(
        f"model: the model {requested!r} is not loaded; this run serves {served} "
        "(omit the field, use \"default\", or pass --ignore-model-field for files written for "
        "another provider)", code="model_not_found", param="model", status_code=404)


def declared(request: Any, name: str) -> Any:
    """A field the request's model declares, or None: getattr would also return an unknown
    field of that name the body carried (pydantic exposes extras as attributes), unchecked."""
    return vars(request).get(name)


def _pick(name: str, request: Any, *layers: Mapping[str, Any]) -> Any:
    value = declared(request, name)
    for layer in layers:
        if value is not None:
            break
        value = layer.get(name)
    return value


def _max_tokens(request: Any, prompt_len: int, max_model_len: int, user: dict, model: dict) -> int:
    room = max_model_len - prompt_len
    if room < 1 and not (room == 0 and request.max_tokens == 0):
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"messages resulted in {prompt_len} tokens, leaving no room for a completion. Please "
            "reduce the length of the messages.", code="context_length_exceeded", param="messages")
    explicit = declared(request, "max_completion_tokens") or request.max_tokens
    if explicit is not None:
        if prompt_len + explicit > max_model_len:
            param = "max_completion_tokens" if declared(request, "max_completion_tokens") \
                else "max_tokens"
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + explicit} tokens ({prompt_len} in the messages, "
                f"{explicit} in the completion). Please reduce the length of the messages or "
                "completion.", code="context_length_exceeded", param=param)
        return explicit
    # A default that does not fit is trimmed to the room left, not an error.
    default = user.get("max_tokens") or model.get("max_tokens")
    if default is None and isinstance(request, CompletionRequest):
        default = COMPLETIONS_MAX_TOKENS
    return min(default, room) if default else room


def _temperature(value: Any) -> float:
    value = float(value)
    return 0.0 if value < GREEDY_BELOW else value


def _token_ids(ids: Mapping[int, Any] | Sequence[int], vocab_size: int | None, param: str) -> None:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise RequestError(f"{param}: token id {bad[0]} is outside the vocabulary "
                           f"(0..{(vocab_size or 1) - 1})", code="invalid_value", param=param)


def _logprobs(request: Any) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _prompt_logprobs(request: Any) -> int | None:
    """vLLM's prompt_logprobs, and what /v1/completions' echo with logprobs needs."""
    asked = [request.prompt_logprobs]
    if isinstance(request, CompletionRequest) and request.echo:
        asked.append(request.logprobs)
    asked = [k for k in asked if k is not None]
    return max(asked) if asked else None


def to_sampling_params(request: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                       max_model_len: int, generation_defaults: Mapping[str, Any] | None = None,
                       defaults: RequestDefaults = RequestDefaults(), *,
                       vocab_size: int | None = None,
                       grammar: GrammarSpec | None = None) -> SamplingParams:
    """Each field from the request, else the user's defaults, else the model's
    generation_config, else OpenAI's defaults.

    The user's command-line defaults come before the model's: someone who types
    `--temperature 0` means it for this run.
    """
    model = dict(generation_defaults or {})
    user = {k: v for k, v in vars(defaults).items() if v is not None}
    max_tokens = _max_tokens(request, prompt_len, max_model_len, user, model)
    if request.min_tokens and request.min_tokens > max_tokens:
        raise RequestError(f"min_tokens: {request.min_tokens} is more than max_tokens "
                           f"({max_tokens})", code="invalid_value", param="min_tokens")
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n or 1):
        raise RequestError("best_of: only best_of equal to n is supported", code="unsupported_value",
                           param="best_of")
    bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
    _token_ids(bias, vocab_size, "logit_bias")
    _token_ids(request.stop_token_ids or [], vocab_size, "stop_token_ids")

    stop = request.stop if isinstance(request.stop, list) else [request.stop] if request.stop else []
    params = SamplingParams(
        n=request.n or 1,
        temperature=_temperature(_pick("temperature", request, user, model, OPENAI_DEFAULTS)),
        top_p=float(_pick("top_p", request, user, model, OPENAI_DEFAULTS)),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens or 0,
        stop=list(stop),
        stop_token_ids=list(request.stop_token_ids or []),
        seed=_pick("seed", request, user, model),
        logit_bias=bias or None,
        ignore_eos=bool(request.ignore_eos),
        logprobs=_logprobs(request),
        prompt_logprobs=_prompt_logprobs(request),
        grammar=grammar,
    )
    if request.skip_special_tokens is not None:
        params.skip_special_tokens = request.skip_special_tokens
    for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _pick(name, request, user, model)
        if value is not None:
            setattr(params, name, value)
    if params.top_k == -1:  # vLLM's spelling of "off"
        params.top_k = 0
    return params
