"""Scoring on the bundled model through the OpenAI adapter: /v1/completions `echo` + `logprobs`
and vLLM's `prompt_logprobs` give transformers' log_softmax of the same tokens to 1e-4 (float32),
whatever the prefix cache holds."""

import itertools

import pytest
import torch
from openai.types import Completion

from batchrun.openai.serving import OpenAIServing
from tests.integration.prompts import PARITY_CHATS

COMPLETIONS = "/v1/completions"
TOL = 1e-4
_ids = itertools.count()


def run(model, prepared):
    """The prepared request through the engine; returns the finished outputs in prompt order."""
    engine = model.engine
    rids = [f"score-{next(_ids)}" for _ in prepared.prompts]
    for rid, prompt in zip(rids, prepared.prompts):
        engine.add_request(rid, prompt, prepared.params)
    done = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in rids]


def complete(model, body):
    prepared = OpenAIServing(model).prepare(COMPLETIONS, body)
    outs = run(model, prepared)
    result = prepared.finalize(outs)
    # The first prompt token's null logprob is what OpenAI returned, though the SDK's types
    # say float: check everything else.
    Completion.model_validate({**result, "choices": [
        {**c, "logprobs": None} for c in result["choices"]]})
    return prepared, outs, result


_references: dict[tuple[int, ...], torch.Tensor] = {}


def reference(hf, ids):
    """log_softmax rows: row p scores token p + 1."""
    key = tuple(ids)
    if key not in _references:
        with torch.no_grad():
            _references[key] = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return _references[key]


def long_text(tok, n=2000):
    text = " ".join(m["content"] for chat in PARITY_CHATS for m in chat)
    ids = []
    k = 1
    while len(ids) < n:
        ids = tok(f"Part {k}. " + text * k)["input_ids"]
        k += 1
    return tok.decode(ids[:n])


@pytest.fixture(scope="module")
def prompts(real_model):
    tok = real_model.tokenizer
    question = ("Question: Which planet is known as the red planet? It is the fourth planet "
                "from the sun and has two small moons.\nAnswer:")
    return {
        "short": ["Hello"],
        "sentence": ["The capital of France is Paris."],
        "long": [long_text(tok)],
        "choices": [question + a for a in (" Mars", " Venus", " Jupiter", " Saturn's moon Titan")],
        # Token ids: plain text, and a chat-rendered prompt with its special tokens.
        "ids": [tok("def add(a, b):\n    return a + b\n")["input_ids"],
                tok.apply_chat_template(PARITY_CHATS[7], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]],
    }


def check_echo(result, outs, hf, k):
    for choice, out in zip(result["choices"], outs):
        ids = out.prompt_token_ids
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == \
            len(lp["text_offset"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(hf, ids)
        targets = torch.tensor(ids[1:], dtype=torch.long)
        expected = ref[torch.arange(len(ids) - 1), targets]
        ours = torch.tensor(lp["token_logprobs"][1:], dtype=torch.float32)
        assert torch.all((ours - expected).abs() < TOL)
        best = ref[:-1].max(dim=-1).values.tolist()
        for p in range(len(ids) - 1):
            top = lp["top_logprobs"][p + 1]
            assert len(top) <= k  # fewer only when two tokens spell the same text
            assert abs(max(top.values()) - best[p]) < TOL
        assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("kind", ["short", "sentence", "long", "choices", "ids"])
def test_echo_logprobs_match_transformers_cold_and_cached(real_model, hf_real_model, prompts,
                                                          kind):
    body = {"prompt": prompts[kind], "echo": True, "logprobs": 2, "max_tokens": 0,
            "temperature": 0}
    first = complete(real_model, body)
    again = complete(real_model, body)
    for _, outs, result in (first, again):
        check_echo(result, outs, hf_real_model, 2)
        for choice, text in zip(result["choices"], prompts[kind]):
            if isinstance(text, str):
                assert choice["text"] == text  # max_tokens 0: the prompt and nothing else
            assert choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 0
    if kind in ("long", "choices"):
        # The second run comes from the prefix cache, yet gives the same entries.
        assert again[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for a, b in zip(first[2]["choices"], again[2]["choices"]):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]


def test_echo_with_one_generated_token(real_model, hf_real_model, prompts):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    ids = prompts["ids"][0]
    _, outs, result = complete(real_model, {"prompt": [ids], "echo": True, "logprobs": 1,
                                            "max_tokens": 1, "temperature": 0})
    choice = result["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    ref = reference(hf_real_model, ids)
    assert abs(lp["token_logprobs"][-1] - float(ref[-1].max())) < TOL  # greedy: the top token
    assert choice["text"].startswith(real_model.tokenizer.decode(ids))
    assert result["usage"]["completion_tokens"] == 1
    check_echo({"choices": [{"logprobs": {k: v[:-1] for k, v in lp.items()}}]}, outs,
               hf_real_model, 1)


def test_vllm_prompt_logprobs_on_completions_and_chat(real_model, hf_real_model, prompts):
    _, outs, result = complete(real_model, {"prompt": prompts["choices"][:2], "prompt_logprobs": 3,
                                            "max_tokens": 1, "temperature": 0})
    for choice, out in zip(result["choices"], outs):
        check_vllm(choice["prompt_logprobs"], out.prompt_token_ids, hf_real_model, 3)
        assert not choice["text"].startswith("Question")  # no echo asked
        assert choice["logprobs"] is None
    serving = OpenAIServing(real_model)
    prepared = serving.prepare("/v1/chat/completions", {
        "messages": PARITY_CHATS[3], "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0})
    out = run(real_model, prepared)[0]
    body = prepared.finalize(out)
    check_vllm(body["prompt_logprobs"], out.prompt_token_ids, hf_real_model, 0)


def check_vllm(entries, ids, hf, k):
    assert len(entries) == len(ids) and entries[0] is None
    ref = reference(hf, ids)
    for p, entry in enumerate(entries[1:]):
        actual = entry[str(ids[p + 1])]
        assert abs(actual["logprob"] - float(ref[p, ids[p + 1]])) < TOL
        assert actual["rank"] == int((ref[p] > ref[p, ids[p + 1]]).sum()) + 1
        top = ref[p].topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in top} | {str(ids[p + 1])}
        for r, t in enumerate(top, 1):
            if t != ids[p + 1]:
                assert entry[str(t)]["rank"] == r
