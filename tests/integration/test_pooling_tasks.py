"""/v1/classify, /v1/score and /v1/rerank on tiny random *ForSequenceClassification checkpoints
(native Llama / Qwen2 / Qwen3, Gemma and GPT-NeoX on the transformers backend) and a plain causal
LM, against transformers on the same weights: the classification head's logits, softmax and
labels; a cross-encoder's sigmoid of the pair's logit (the pair tokenised by transformers'
tokenizer); the cosine of last-token embeddings where there is no head. Then the same
requests as batch lines (`run`, `validate`, `plan`), over HTTP (`serve`, httpx) and through the
Batches API."""

import json
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner

from batchrun.batch.job.result import RequestCounts
from batchrun.batch.job.runner import run_batch
from batchrun.batch.shell.commands import plan, validate
from batchrun.llm import load_from_path
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.openai.wire import RequestError
from batchrun.options.engine import EngineConfig
from batchrun.options.openai import OpenAIOptions
from tests.helpers import batchrun, file_records, job_plan, poll_batch, upload_batch_file
from tests.openai_batch_shape import error_of
from tests.server.conftest import API_KEY, serve
from tests.tiny_classifiers import LABELS, make_tiny_classifier

TEXTS = ["I loved every minute of this film.", "Terrible service, never again",
         "The parcel arrived on Tuesday.", "ok", "I loved every minute of this film."]
QUERY = "Where is the Eiffel Tower?"
DOCS = ["The Eiffel Tower is in Paris.", "Bananas are yellow.",
        "Paris is the capital of France and home to the Eiffel Tower.", "Tuesday"]
# Qwen3-Reranker's prompt as its model card writes it: what the shipped template must render.
QWEN3_RERANK = ('<|im_start|>system\nJudge whether the Document meets the requirements based on '
                'the Query and the Instruct provided. Note that the answer can only be "yes" or '
                '"no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, '
                'retrieve relevant passages that answer the query\n<Query>: {q}\n<Document>: '
                '{d}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
TEMPLATES = Path(__file__).parents[2] / "batchrun" / "openai" / "templates"
CHAT = [{"role": "system", "content": "Rate the review."}, {"role": "user", "content": TEXTS[0]},
        {"role": "assistant", "content": "It is"}]


class Tiny:
    def __init__(self, arch, path, num_labels, causal=False):
        from transformers import AutoTokenizer

        self.hf = make_tiny_classifier(arch, path, num_labels, causal=causal)
        self.model = load_from_path(path, EngineConfig.default(block_size=4))
        self.serving = OpenAIServing(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)  # transformers' own, the reference
        self.path = path

    def run(self, url, body, serving=None):
        prepared = (serving or self.serving).prepare(url, body)
        return prepared.finalize(self.model.engine.generate(prepared.prompts, prepared.params))

    def logits(self, text, pair=None):
        ids = self.tokenizer(text, text_pair=pair)["input_ids"]
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].double()

    def chat_ids(self, messages, **kw):
        """transformers' own rendering of a chat (the reference for the `messages` form)."""
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                       **kw)["input_ids"])

    def embedding(self, text):
        ids = self.tokenizer(text)["input_ids"] if isinstance(text, str) else text
        with torch.no_grad():
            states = self.hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        return states[0, -1].double()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(arch, num_labels, causal=False):
        key = (arch, num_labels, causal)
        if key not in made:
            made[key] = Tiny(arch, tmp_path_factory.mktemp(f"{arch}-{num_labels}"), num_labels,
                             causal)
        return made[key]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "gpt_neox"])
def test_classify_equals_transformers(tiny, arch):
    t = tiny(arch, 3)
    impl = type(t.model.engine.runner.model).__name__
    assert impl == ("TransformersModel" if arch in ("gemma", "gpt_neox") else "LlamaModel")
    body = t.run("/v1/classify", {"input": TEXTS})
    raw = t.run("/v1/classify", {"input": TEXTS[1], "use_activation": False})
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert isinstance(body["created"], int) and body["model"] == t.model.name
    tokens = [len(t.tokenizer(x)["input_ids"]) for x in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens),
                             "completion_tokens": 0, "prompt_tokens_details": None}
    for i, text in enumerate(TEXTS):
        want = t.logits(text)
        item = body["data"][i]
        assert item["index"] == i and item["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(item["probs"], dtype=torch.double),
                                   want.softmax(0), atol=1e-5, rtol=1e-4)
        assert item["label"] == LABELS[int(want.argmax())]
    torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"], dtype=torch.double),
                               t.logits(TEXTS[1]), atol=1e-4, rtol=1e-4)
    ids = [5, 6, 7, 0, 0]  # ends in pad_token_id 0: transformers reads the head at position 2
    padded = t.run("/v1/classify", {"input": ids, "use_activation": False})
    with torch.no_grad():
        want = t.hf(torch.tensor([ids])).logits[0].double()
    torch.testing.assert_close(torch.tensor(padded["data"][0]["probs"], dtype=torch.double),
                               want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "gemma"])
def test_classify_chat_messages_equal_transformers(tiny, arch):
    """vLLM's chat form: the messages rendered by the chat template, without the assistant
    prompt unless add_generation_prompt; continue_final_message leaves the last one open."""
    t = tiny(arch, 3)
    for extra in ({}, {"add_generation_prompt": True}, {"continue_final_message": True}):
        messages = CHAT if extra.get("continue_final_message") else CHAT[:2]
        body = t.run("/v1/classify", {"messages": messages, "use_activation": False, **extra})
        ids = t.chat_ids(messages, add_generation_prompt=extra.get("add_generation_prompt",
                                                                    False), **{
            k: v for k, v in extra.items() if k == "continue_final_message"})
        with torch.no_grad():
            want = t.hf(torch.tensor([ids])).logits[0].double()
        torch.testing.assert_close(torch.tensor(body["data"][0]["probs"], dtype=torch.double),
                                   want, atol=1e-4, rtol=1e-4)
        assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(ids), extra


def test_embeddings_chat_messages_equal_transformers(tiny):
    t = tiny("llama", 0, causal=True)
    body = t.run("/v1/embeddings", {"messages": CHAT[:2]})
    want = torch.nn.functional.normalize(t.embedding(t.chat_ids(CHAT[:2])), dim=0)
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"], dtype=torch.double),
                               want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox"])
def test_cross_encoder_score_and_rerank_equal_transformers(tiny, arch):
    t = tiny(arch, 1)
    want = [float(torch.sigmoid(t.logits(QUERY, d))[0]) for d in DOCS]
    score = t.run("/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert score["object"] == "list" and score["id"].startswith("score-")
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in score["data"]} == {"score"}
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    pair_tokens = sum(len(t.tokenizer(QUERY, text_pair=d)["input_ids"]) for d in DOCS)
    assert score["usage"]["prompt_tokens"] == pair_tokens
    # vLLM's newer names, and lists paired one to one
    newer = t.run("/v1/score", {"queries": [QUERY] * 4, "documents": DOCS})
    assert [d["score"] for d in newer["data"]] == pytest.approx(want, abs=1e-5)
    zipped = t.run("/v1/score", {"text_1": [DOCS[0], QUERY], "text_2": [QUERY, DOCS[0]]})
    assert zipped["data"][0]["score"] == pytest.approx(
        float(torch.sigmoid(t.logits(DOCS[0], QUERY))[0]), abs=1e-5)
    raw = t.run("/v1/score", {"text_1": QUERY, "text_2": DOCS[1], "use_activation": False})
    assert raw["data"][0]["score"] == pytest.approx(float(t.logits(QUERY, DOCS[1])[0]), abs=1e-4)

    rerank = t.run("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    order = sorted(range(4), key=lambda i: -want[i])[:3]
    assert rerank["id"].startswith("rerank-") and rerank["model"] == t.model.name
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-5)
    assert [r["document"] for r in rerank["results"]] == [{"text": DOCS[i]} for i in order]
    assert rerank["usage"] == {"prompt_tokens": pair_tokens, "total_tokens": pair_tokens}
    bare = t.run("/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
    assert len(bare["results"]) == 4 and all("document" not in r for r in bare["results"])


def test_yes_no_reranker_with_a_score_template_equals_transformers(tiny, tmp_path):
    """--score-tokens no,yes --score-template (the Qwen3-Reranker template shipped): a pair's
    score is the softmax over the two tokens' logits at the last position of the templated
    prompt, as transformers computes it; one token: the sigmoid of its logit."""
    t = tiny("qwen3", 0, causal=True)
    options = OpenAIOptions(score_tokens="no,yes",
                            score_template=str(TEMPLATES / "qwen3_reranker.jinja"))
    serving = OpenAIServing(t.model, ServingOptions.of(options))
    no, yes = t.tokenizer.convert_tokens_to_ids(["no", "yes"])

    def last_logits(ids):
        with torch.no_grad():
            return t.hf(torch.tensor([ids])).logits[0, -1].double()
    pairs = [last_logits(t.tokenizer(QWEN3_RERANK.format(q=QUERY, d=d))["input_ids"])[[no, yes]]
             for d in DOCS]
    want = [float(p.softmax(0)[1]) for p in pairs]
    score = t.run("/v1/score", {"text_1": QUERY, "text_2": DOCS}, serving)
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    raw = t.run("/v1/score", {"queries": QUERY, "documents": DOCS, "use_activation": False},
                serving)
    assert [d["score"] for d in raw["data"]] == pytest.approx(
        [float(p[1] - p[0]) for p in pairs], abs=1e-4)
    rerank = t.run("/v1/rerank", {"query": QUERY, "documents": DOCS}, serving)
    assert [r["index"] for r in rerank["results"]] == sorted(range(4), key=lambda i: -want[i])
    # /v1/classify over the two tokens (the input as given), and generation still works
    body = t.run("/v1/classify", {"input": TEXTS[0]}, serving)
    logits = last_logits(t.tokenizer(TEXTS[0])["input_ids"])[[no, yes]]
    assert body["data"][0]["label"] == ["no", "yes"][int(logits.argmax())]
    assert body["data"][0]["probs"] == pytest.approx(logits.softmax(0).tolist(), abs=1e-5)
    serving.prepare("/v1/completions", {"prompt": "x", "max_tokens": 1})
    # one token, no template: the tokenizer's pair encoding, the sigmoid of the token's logit
    one = OpenAIServing(t.model, ServingOptions.of(OpenAIOptions(score_tokens="yes")))
    got = t.run("/v1/score", {"text_1": QUERY, "text_2": DOCS[0]}, one)
    logit = last_logits(t.tokenizer(QUERY, text_pair=DOCS[0])["input_ids"])[yes]
    assert got["data"][0]["score"] == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)
    for bad, model in [("yes,definitely not", t), ("", t), ("no,yes", tiny("llama", 3))]:
        with pytest.raises(ValueError, match="--score-tokens"):
            OpenAIServing(model.model, ServingOptions.of(OpenAIOptions(score_tokens=bad)))
    src = tmp_path / "in.jsonl"  # and from the command line, a usage error before any line
    src.write_text(json.dumps(_lines()[2]) + "\n")
    result = CliRunner().invoke(validate, [str(src), "--check-prompts", "--model", str(t.path),
                                           "--score-tokens", "yes,definitely not"])
    assert result.exit_code == 2 and "'definitely not' is not one token" in result.output


def test_without_a_head_score_is_the_cosine_of_embeddings(tiny):
    t = tiny("llama", 0, causal=True)
    q = t.embedding(QUERY)
    want = [float(torch.nn.functional.cosine_similarity(q, t.embedding(d), dim=0)) for d in DOCS]
    score = t.run("/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    # the query is embedded once, not once per document
    distinct = sum(len(t.tokenizer(x)["input_ids"]) for x in [QUERY, *DOCS])
    assert score["usage"]["prompt_tokens"] == distinct
    rerank = t.run("/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert [r["index"] for r in rerank["results"]] == sorted(range(4), key=lambda i: -want[i])


def test_what_a_model_cannot_do_is_a_400_naming_it(tiny):
    causal, classifier = tiny("llama", 0, causal=True), tiny("llama", 3)
    for t, url, body in [
            (causal, "/v1/classify", {"input": "x"}),
            (classifier, "/v1/score", {"text_1": "a", "text_2": "b"}),
            (classifier, "/v1/rerank", {"query": "a", "documents": ["b"]}),
            (classifier, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            (classifier, "/v1/completions", {"prompt": "x"})]:
        with pytest.raises(RequestError) as e:
            t.serving.prepare(url, body)
        assert (e.value.code, e.value.param, e.value.status_code) == \
            ("unsupported_task", "model", 400), url
        assert t.model.name in e.value.message


@pytest.mark.parametrize("url, body, param", [
    ("/v1/classify", {"input": []}, "input"),
    ("/v1/classify", {"input": 5}, "input"),
    ("/v1/classify", {"input": "x", "use_activation": "yes"}, "use_activation"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"queries": "a", "documents": []}, "documents"),
    ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["b"]}, "query"),
    ("/v1/classify", {}, "input"),
    ("/v1/classify", {"input": "x", "messages": CHAT}, "messages"),
    ("/v1/classify", {"messages": []}, "messages"),
    ("/v1/classify", {"messages": CHAT, "add_generation_prompt": True,
                      "continue_final_message": True}, "continue_final_message"),
    ("/v1/embeddings", {"input": "x", "messages": CHAT}, "messages"),
    ("/v1/embeddings", {"dimensions": 3}, "input"),
])
def test_bad_bodies_name_the_field(tiny, url, body, param):
    with pytest.raises(RequestError) as e:
        tiny("llama", 0, causal=True).serving.prepare(url, body)
    assert e.value.param == param and e.value.status_code == 400


def _lines():
    return [
        {"custom_id": "cls", "method": "POST", "url": "/v1/classify",
         "body": {"input": TEXTS[:2]}},
        {"custom_id": "score", "method": "POST", "url": "/v1/score",
         "body": {"text_1": QUERY, "text_2": DOCS}},
        {"custom_id": "rerank", "method": "POST", "url": "/v1/rerank",
         "body": {"query": QUERY, "documents": DOCS, "top_n": 2}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/rerank",
         "body": {"query": QUERY, "documents": DOCS, "top_n": "2"}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/classify",
         "body": {"messages": CHAT[:2]}},
    ]


def _good():
    return [line for line in _lines() if line["custom_id"] != "bad"]


def _same(got, want):
    """Two bodies of one endpoint equal but for ids, timestamps and float rounding."""
    for key in ("data", "results"):
        if key in want:
            assert json.dumps(got[key]).count("index") == json.dumps(want[key]).count("index")
            for a, b in zip(got[key], want[key]):
                for k, v in b.items():
                    assert a[k] == (pytest.approx(v, abs=1e-6) if k != "document" else v), k
    assert got["usage"] == want["usage"] and got["model"] == want["model"]


def test_batch_lines_run_validate_and_plan(tiny, tmp_path):
    t = tiny("qwen2", 1)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in _lines()))
    for checked in ([], ["--check-prompts", "--model", str(t.path)]):
        result = CliRunner().invoke(validate, [str(src), "--json", *checked])
        problems = [json.loads(x) for x in result.stdout.splitlines() if x.strip()]
        assert [(error_of(p)["line"], error_of(p)["param"]) for p in problems] == [(4, "top_n")]
    estimate = CliRunner().invoke(plan, [str(src), "--model", str(t.path), "--json",
                                         "--calibration", "benchmark"])
    assert estimate.exit_code == 0, estimate.output
    got = json.loads(estimate.stdout)
    assert (got["lines"], got["valid"], got["invalid"]) == (5, 4, 1)
    assert got["requests"] == 2 + 4 + 4 + 1 and got["requested_completion_tokens"] == 0
    summary = run_batch(t.model, job_plan(input=str(src), output=str(tmp_path / "out.jsonl"),
                                          progress="none"))
    assert summary.requests == RequestCounts(5, 4, 1)
    # and `batchrun run` itself, loading the checkpoint from its folder
    proc = batchrun("run", src, "-o", tmp_path / "cli.jsonl", "--model", t.path, real=True,
                    timeout=300, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("out", "cli"):
        out = {o["custom_id"]: o["response"]["body"]
               for o in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}
        for line in _good():
            _same(out[line["custom_id"]], t.run(line["url"], line["body"]))
        errors = [json.loads(x)
                  for x in (tmp_path / f"{name}.errors.jsonl").read_text().splitlines()]
        assert [(e["custom_id"], error_of(e)["param"], error_of(e)["line"]) for e in errors] \
            == [("bad", "top_n", 4)]


def test_serve_routes_and_batches_api(tiny, tmp_path):
    t = tiny("qwen2", 1)
    with serve(t.model, tmp_path) as running:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=60) as http:
            for line in _good():
                r = http.post(line["url"], json=line["body"])
                assert r.status_code == 200, r.text
                _same(r.json(), t.run(line["url"], line["body"]))
            r = http.post("/v1/rerank", json=_lines()[3]["body"])
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"
            r = http.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
        client = running.client()
        for line in _good():
            f = upload_batch_file(client, [line, {**line, "custom_id": "again"}])
            batch = poll_batch(client, client.batches.create(
                input_file_id=f.id, endpoint=line["url"], completion_window="24h").id)
            assert batch.status == "completed" and batch.request_counts.completed == 2
            records = file_records(client, batch.output_file_id)
            want = t.run(line["url"], line["body"])
            for record in records:
                assert record["response"]["status_code"] == 200
                _same(record["response"]["body"], want)
            assert batch.usage.input_tokens == 2 * want["usage"]["prompt_tokens"]
            assert batch.usage.output_tokens == 0

