"""/v1/embeddings in the OpenAI adapter: validation (400s naming the field, batch lines naming
line and field), pooling defaults from a sentence-transformers config, the response shape
(openai.types.CreateEmbeddingResponse), base64 and dimensions, on a tiny random engine."""

import base64
import json
import math
import struct

import pytest
import torch
from openai.types import CreateEmbeddingResponse

from batchrun.batch.job.runner import prepare_line
from batchrun.engine.pooling import PoolingParams
from batchrun.llm import LoadedModel
from batchrun.openai.embeddings import resolve_pooling, sentence_transformers_pooling, truncate
from batchrun.openai.wire import LineError, RequestError
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions
from tests.helpers import tiny_engine

URL = "/v1/embeddings"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    _, engine = tiny_engine("llama", path)
    return LoadedModel(engine, engine.tokenizer, "tiny", (), {}, path)


def serving(model, **options):
    return OpenAIServing(model, ServingOptions.of(OpenAIOptions(**options)))


def run(model, body, **options):
    prepared = serving(model, **options).prepare(URL, body)
    outs = model.engine.generate(prepared.prompts, prepared.params)
    return prepared.finalize(outs)


def error(model, body, **options) -> RequestError:
    with pytest.raises(RequestError) as e:
        serving(model, **options).prepare(URL, body)
    return e.value


def test_response_is_openai_shaped_with_usage(tiny):
    body = run(tiny, {"input": [[5, 6, 7], [8, 9, 10, 11, 12]], "model": "tiny", "user": "u"})
    CreateEmbeddingResponse.model_validate(body)
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    for d in body["data"]:
        assert len(d["embedding"]) == 128
        assert math.isclose(sum(x * x for x in d["embedding"]), 1.0, rel_tol=1e-5)


def test_base64_is_little_endian_float32(tiny):
    floats = run(tiny, {"input": [5, 6, 7]})["data"][0]["embedding"]
    b64 = run(tiny, {"input": [5, 6, 7], "encoding_format": "base64"})
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    # The type describes the client's result, which decodes base64 into floats first.
    CreateEmbeddingResponse.model_validate(
        {**b64, "data": [{**b64["data"][0], "embedding": list(decoded)}]})
    assert list(decoded) == [struct.unpack("<f", struct.pack("<f", x))[0] for x in floats]


def test_dimensions_truncate_and_renormalise(tiny):
    full = run(tiny, {"input": [5, 6, 7]})["data"][0]["embedding"]
    short = run(tiny, {"input": [5, 6, 7], "dimensions": 16})["data"][0]["embedding"]
    want = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(short), want)
    raw = run(tiny, {"input": [5, 6, 7], "dimensions": 16}, normalize=False)
    assert len(raw["data"][0]["embedding"]) == 16
    assert truncate([3.0, 4.0, 1.0], 2, True) == [0.6, 0.8]
    assert truncate([3.0, 4.0, 1.0], 2, False) == [3.0, 4.0]


def test_pooling_options_reach_the_engine(tiny):
    p = serving(tiny, pooling="mean", normalize=False).prepare(URL, {"input": [5, 6]}).params
    assert (p.max_tokens, p.pooling) == (0, PoolingParams("mean", False))
    assert serving(tiny).prepare(URL, {"input": [5]}).params.pooling == PoolingParams("last", True)


def test_an_input_of_exactly_max_model_len_tokens_is_embedded_and_one_more_is_refused(tiny):
    limit = tiny.max_model_len
    out = run(tiny, {"input": [5] * limit})
    assert out["usage"]["prompt_tokens"] == limit and len(out["data"]) == 1
    assert all(math.isfinite(x) for x in out["data"][0]["embedding"])
    assert error(tiny, {"input": [5] * (limit + 1)}).code == "context_length_exceeded"


@pytest.mark.parametrize("body, param, code", [
    ({}, "input", "missing_required_parameter"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [[]]}, "input", "invalid_value"),
    ({"input": [[5], []]}, "input", "invalid_value"),
    ({"input": ["x"] * 2049}, "input", "invalid_value"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": [1.5]}, "input.0", "invalid_type"),
    ({"input": [5], "encoding_format": "hex"}, "encoding_format", "invalid_value"),
    ({"input": [5], "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": [5], "dimensions": 129}, "dimensions", "invalid_value"),
    ({"input": [5], "model": "other"}, "model", "model_not_found"),
    ({"input": [5] * 10_000}, "input", "context_length_exceeded"),
])
def test_bad_requests_name_the_field(tiny, body, param, code):
    e = error(tiny, body)
    assert (e.param, e.code) == (param, code), e.message
    assert e.status_code in (400, 404)


def test_a_bad_batch_line_names_line_and_field(tiny):
    raw = json.dumps({"custom_id": "e1", "method": "POST", "url": URL,
                      "body": {"input": [5], "dimensions": -1}})
    with pytest.raises(LineError) as e:
        prepare_line(raw, 7, serving(tiny))
    assert (e.value.line_number, e.value.param, e.value.custom_id) == (7, "dimensions", "e1")
    ok = prepare_line(json.dumps({"custom_id": "e2", "method": "POST", "url": URL,
                                  "body": {"input": [[5, 6], [7]]}}), 8, serving(tiny))
    assert [p for _, p in ok.engine_requests] == [[5, 6], [7]]


def st_folder(tmp_path, modes: dict, normalize: bool):
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 128, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, **modes}))
    return tmp_path


def test_sentence_transformers_config_sets_the_defaults(tmp_path):
    assert sentence_transformers_pooling(tmp_path) == (None, None)
    assert resolve_pooling(None, None, tmp_path) == PoolingParams("last", True)
    st = st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    assert sentence_transformers_pooling(st) == ("mean", False)
    assert resolve_pooling(None, None, st) == PoolingParams("mean", False)
    assert resolve_pooling("cls", True, st) == PoolingParams("cls", True)  # options win
    assert resolve_pooling(None, True, st) == PoolingParams("mean", True)


def test_sentence_transformers_cls_with_normalize(tmp_path):
    st = st_folder(tmp_path, {"pooling_mode_cls_token": True}, normalize=True)
    assert resolve_pooling(None, None, st) == PoolingParams("cls", True)
    (tmp_path / "max").mkdir()
    unsupported = st_folder(tmp_path / "max", {"pooling_mode_max_tokens": True}, normalize=True)
    assert resolve_pooling(None, None, unsupported) == PoolingParams("last", True)


def test_pooling_options_on_the_command_line():
    from batchrun.options.click_options import click_options
    from batchrun.options.run import from_cli
    import click
    from click.testing import CliRunner

    seen = {}

    @click.command()
    @click_options(OpenAIOptions)
    def cmd(**kwargs):
        seen["opts"] = from_cli(OpenAIOptions, kwargs)

    cases = [([], (None, None)), (["--pooling", "mean", "--no-normalize"], ("mean", False)),
             (["--normalize"], (None, True))]
    for args, want in cases:
        assert CliRunner().invoke(cmd, args).exit_code == 0
        assert (seen["opts"].pooling, seen["opts"].normalize) == want
    assert CliRunner().invoke(cmd, ["--pooling", "max"]).exit_code == 2
