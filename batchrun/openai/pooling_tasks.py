"""/v1/classify, /v1/score and /v1/rerank: pooled engine requests in, vLLM's response bodies out.

    classify  {"id": "classify-…", "object": "list", "created", "model",
               "data": [{"index", "label", "probs", "num_classes"}], "usage"}
    score     {"id": "score-…", "object": "list", "created", "model",
               "data": [{"index", "object": "score", "score"}], "usage"}
    rerank    {"id": "rerank-…", "model", "usage": {"prompt_tokens", "total_tokens"},
               "results": [{"index", "relevance_score", "document": {"text"}}]}  best first

What a model can do decides how: a sequence classifier (`*ForSequenceClassification`) runs
each input through its head (PoolingParams(head=True)): classify gives the softmax of its
logits (sigmoid for a single label) and the label of the largest; with a single label it is a
cross-encoder, and score / rerank tokenise each pair as tokenizer(text_1, text_pair=text_2)
(or render it with --score-template) and give the sigmoid of its logit. A causal LM run with
--score-tokens is read the same way over those tokens' logits (PoolingParams.token_ids): a
`no,yes` pair scores by the sigmoid of yes - no, the softmax over the two at yes. A model
without a head scores a pair by the cosine of the two texts' embeddings (the /v1/embeddings
pooling). `use_activation: false` gives raw logits.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from batchrun.engine.outputs import RequestOutput
from batchrun.engine.pooling import PoolingParams
from batchrun.engine.sampling_params import SamplingParams
from batchrun.models.config.classifier import ClassifierHead, folder_head, token_head
from batchrun.openai.render import render_score_pair
from batchrun.openai.pooling_requests import ClassifyRequest, RerankRequest, ScoreRequest
from batchrun.openai.wire import RequestError



def model_head(path, tokenizer, score_tokens: str | None, model_name: str
               ) -> ClassifierHead | None:
    """A sequence classifier's head (labels, padding) from the model folder's config, or
    --score-tokens' head over a causal LM's logits; None: no head. ValueError for a token that
    is not one, or --score-tokens on a classifier."""
    head = folder_head(path)
    if score_tokens is None:
        return head
    if head is not None:
        raise ValueError(f"--score-tokens: {model_name!r} is a sequence classifier (its own "
                         "head scores); the option reads a causal LM's logits")
    return token_head(tokenizer, score_tokens)


def pair_prompt(tokenizer, score_template: str | None, query: str, document: str) -> list[int]:
    """A cross-encoder's one sequence of a pair: --score-template's rendering, else the
    tokenizer's pair encoding."""
    if score_template:
        return render_score_pair(tokenizer, score_template, query, document)
    return list(tokenizer(query, text_pair=document)["input_ids"])


def head_params(head: ClassifierHead) -> PoolingParams:
    """What a pooled request through `head` asks of the engine."""
    return PoolingParams("last", normalize=False, head=not head.token_ids,
                         token_ids=head.token_ids)


def _usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def activate(logits: Sequence[float]) -> list[float]:
    """What vLLM's classification pooler applies: softmax over several labels, sigmoid of one."""
    if len(logits) == 1:
        return [_sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


@dataclass
class ClassifyFormatter:
    model_name: str
    labels: list[str]
    activation: bool = True

    def body(self, outputs: Sequence[RequestOutput], created: int | None = None) -> dict[str, Any]:
        data = []
        for i, out in enumerate(outputs):
            logits = list(out.embedding or [])
            probs = activate(logits) if self.activation else logits
            best = max(range(len(logits)), key=logits.__getitem__)
            data.append({"index": i, "label": self.labels[best], "probs": probs,
                         "num_classes": len(self.labels)})
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                "created": created or int(time.time()), "model": self.model_name, "data": data,
                "usage": _usage(outputs)}


@dataclass
class ScoreFormatter:
    """pairs: None for a cross-encoder (output i is pair i, `pair_logit` of its logits), else
    the output indexes of each pair's two embeddings."""
    model_name: str
    pairs: list[tuple[int, int]] | None
    activation: bool = True
    pair_logit: Callable[[list[float]], float] = lambda logits: logits[0]

    def scores(self, outputs: Sequence[RequestOutput]) -> list[float]:
        if self.pairs is None:
            logits = [self.pair_logit(list(o.embedding or [0.0])) for o in outputs]
            return [_sigmoid(x) for x in logits] if self.activation else logits
        return [cosine(outputs[a].embedding or [], outputs[b].embedding or [])
                for a, b in self.pairs]

    def body(self, outputs: Sequence[RequestOutput], created: int | None = None) -> dict[str, Any]:
        data = [{"index": i, "object": "score", "score": s}
                for i, s in enumerate(self.scores(outputs))]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": created or int(time.time()), "model": self.model_name, "data": data,
                "usage": _usage(outputs)}


@dataclass
class RerankFormatter(ScoreFormatter):
    documents: Sequence[str] = ()
    top_n: int | None = None
    return_documents: bool = True

    def body(self, outputs: Sequence[RequestOutput], created: int | None = None) -> dict[str, Any]:
        ranked = sorted(enumerate(self.scores(outputs)), key=lambda item: -item[1])
        if self.top_n:
            ranked = ranked[:self.top_n]
        results = []
        for index, score in ranked:
            result: dict[str, Any] = {"index": index, "relevance_score": score}
            if self.return_documents:
                result["document"] = {"text": self.documents[index]}
            results.append(result)
        usage = _usage(outputs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name,
                "usage": {"prompt_tokens": usage["prompt_tokens"],
                          "total_tokens": usage["total_tokens"]},
                "results": results}


def _unsupported(task: str, model_name: str, why: str) -> RequestError:
    return RequestError(f"{task}: the model {model_name!r} {why}", code="unsupported_task",
                        param="model")


def prepare_classify(request: ClassifyRequest, prompts: list[list[int]],
                     head: ClassifierHead | None, model_name: str, adapter: str | None):
    """(prompts, params, formatter) of a /v1/classify request whose inputs are `prompts`."""
    if head is None:
        raise _unsupported("/v1/classify", model_name, "has no sequence-classification head "
                           "(a *ForSequenceClassification checkpoint classifies)")
    params = SamplingParams(max_tokens=0, pooling=head_params(head), lora=adapter)
    fmt = ClassifyFormatter(adapter or model_name, head.labels,
                            request.use_activation is not False)
    return [head.pooled_prompt(p) for p in prompts], params, fmt


def prepare_scoring(url: str, request: ScoreRequest | RerankRequest, pair_prompt, token_prompts,
                    head: ClassifierHead | None, pooling: PoolingParams | None,
                    model_name: str, adapter: str | None):
    """(prompts, params, formatter) of a /v1/score or /v1/rerank request; `pair_prompt(a, b)`
    gives a pair's token ids for a cross-encoder, `token_prompts(texts, field)` texts' token ids
    as the embeddings endpoint makes them."""
    if head is not None and not head.scores_pairs:
        raise _unsupported(url, model_name, f"classifies into {len(head.labels)} labels; scoring "
                           "needs a cross-encoder (one label, or --score-tokens) or a model "
                           "without a head (cosine of embeddings)")
    left, right = request.pairs
    name = adapter or model_name
    activation = request.use_activation is not False
    make: Callable[..., ScoreFormatter] = ScoreFormatter
    if isinstance(request, RerankRequest):
        make = functools.partial(RerankFormatter, documents=request.documents,
                                 top_n=request.top_n, return_documents=request.return_documents)
    if head is not None:  # a cross-encoder: each pair is one sequence
        prompts = [head.pooled_prompt(pair_prompt(a, b)) for a, b in zip(left, right)]
        params = SamplingParams(max_tokens=0, pooling=head_params(head), lora=adapter)
        return prompts, params, make(name, None, activation, head.pair_logit)
    texts = list(dict.fromkeys(left + right))  # each distinct text embedded once
    index = {t: i for i, t in enumerate(texts)}
    params = SamplingParams(max_tokens=0, pooling=pooling, lora=adapter)
    pairs = [(index[a], index[b]) for a, b in zip(left, right)]
    return token_prompts(texts, request.second_field), params, make(name, pairs, activation)
