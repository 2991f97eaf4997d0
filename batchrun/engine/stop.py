"""Whether a sequence ends with the token it just took, and why."""

from __future__ import annotations

from batchrun.engine.request import Request


def stop_reason(req: Request, token: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
    """"stop" (stop token, EOS or stop string: req.stop_reason says which), "length" or None.
    Feeds the token to req's detokenizer."""
    p = req.params
    detok = req.detokenizer
    if req.num_output_tokens > p.min_tokens:
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in eos_token_ids:
            return "stop"
        if detok is not None:
            stop = detok.add(token)
            if stop is not None:
                req.stop_reason = stop
                return "stop"
    elif detok is not None:
        detok.add(token)
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
