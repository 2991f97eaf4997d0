"""Issue 28's smaller cases on the bundled model's tokenizer and config (no weights loaded):
`validate --check-prompts`, `plan` and `run` agree on embeddings' `dimensions`; --lora names
that would take over the base model, and a missing adapter, are refused before any load."""

import json

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from batchrun.batch.estimate.job_estimate import run_key
from batchrun.batch.estimate.run_store import save_run
from batchrun.batch.shell.commands import plan, validate
from batchrun.footprint import tokenizer_model
from batchrun.llm import check_adapters
from batchrun.models.lora.adapter import LoraError
from batchrun.openai.wire import RequestError
from batchrun.openai.serving import OpenAIServing
from batchrun.options.engine import EngineConfig
from batchrun.options.lora import LoraConfig
from batchrun.commandkit import UsageError, load_model
from tests.openai_batch_shape import error_of

EMBEDDING = {"input": "hello", "model": "smollm2-135m"}


def embeddings_file(tmp_path, dimensions):
    src = tmp_path / "emb.jsonl"
    src.write_text(json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                               "body": {**EMBEDDING, "dimensions": dimensions}}) + "\n")
    return src


@pytest.fixture(scope="module")
def served():
    return tokenizer_model(None)


def test_the_tokenizer_only_model_refuses_dimensions_past_the_embedding_width(served):
    # SmolLM2-135M's hidden size: what the loaded model (llm.LoadedModel.hidden_size) reports.
    assert served.hidden_size == 576
    serving = OpenAIServing(served)
    serving.prepare("/v1/embeddings", {**EMBEDDING, "dimensions": 576})
    with pytest.raises(RequestError) as e:
        serving.prepare("/v1/embeddings", {**EMBEDDING, "dimensions": 1_000_000})
    assert e.value.param == "dimensions" and "576" in e.value.message


def test_validate_and_plan_refuse_what_run_refuses(tmp_path):
    src = embeddings_file(tmp_path, 1_000_000)
    result = CliRunner().invoke(validate, [str(src), "--check-prompts", "--json"])
    problems = [json.loads(x) for x in result.stdout.splitlines() if x.strip()]
    assert [(error_of(p)["line"], error_of(p)["param"]) for p in problems] == [(1, "dimensions")]
    # A recorded last run to calibrate on: plan does not spend seconds benchmarking.
    save_run({"status": "completed", "requests": {"total": 30, "ok": 30, "failed": 0},
              "prompt_tokens": 1401, "completion_tokens": 1000, "cached_tokens": 224,
              "requested_completion_tokens": 1304, "wall_time_s": 30.0,
              "engine": {"steps": 120}}, run_key("smollm2-135m", EngineConfig()))
    result = CliRunner().invoke(plan, [str(src), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert (got["valid"], got["invalid"]) == (0, 1)


def test_an_adapter_may_not_take_the_reserved_default_name():
    with pytest.raises(ValidationError, match="'default' names the base model"):
        LoraConfig(adapters={"default": "/some/adapter"})


def test_an_adapter_may_not_take_the_base_models_name_or_alias(tmp_path):
    lora = LoraConfig(adapters={"smollm2-135m": str(tmp_path)})
    with pytest.raises(LoraError, match="base model's served name or alias"):
        check_adapters(lora, ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_a_missing_adapter_is_named_with_its_path_not_as_a_model_that_cannot_load(tmp_path):
    missing = tmp_path / "nope"
    config = EngineConfig(lora=LoraConfig(adapters={"tune": str(missing)}))
    with pytest.raises(UsageError) as e:
        load_model(None, config)
    assert e.value.message == f"LoRA adapter 'tune' ({missing}): no such adapter folder"
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        check_adapters(LoraConfig(adapters={"tune": str(tmp_path / "empty")}), ())
