"""The options schema (batchrun/options) is the one declaration of every option: the click
options of run/plan/serve/validate, job specs and --help all come from it."""

import pytest
from click.testing import CliRunner

from batchrun.batch.shell.commands import plan, run, validate
from batchrun.batch.shell.jobspec import JobSpecError, load
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError, public_fields, validate as validate_options
from batchrun.options.job import InputOptions, JobOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.run import RunOptions
from batchrun.options.server import ServerOptions
from batchrun.server.cli import serve

RUN_MODELS = (InputOptions, JobOptions, EngineConfig, OpenAIOptions, RequestDefaults)


def cli_fields(*models):
    return [f for m in models for f in public_fields(m) if f.extra.get("cli", True)]


def command_options(command):
    return {opt: p for p in command.params for opt in p.opts + p.secondary_opts}


@pytest.mark.parametrize("command,models", [
    (run, RUN_MODELS), (plan, RUN_MODELS),
    (serve, (ServerOptions, EngineConfig, OpenAIOptions, RequestDefaults))])
def test_every_public_field_is_one_option_with_its_description(command, models):
    options = command_options(command)
    for f in cli_fields(*models):
        param = options[f.flag.split("/")[0]]
        assert param.name == f.name
        assert param.help.startswith(f.info.description)


def test_public_names_are_unique_across_the_run_models():
    names = [f.name for m in RUN_MODELS for f in public_fields(m) if f.name != "input"]
    assert len(names) == len(set(names))


def test_the_command_line_lands_in_each_concern_and_leaves_the_rest_at_defaults():
    seen = {}
    runner = CliRunner()

    def fake_execute(opts, load):
        seen["opts"] = opts
        return 0

    import batchrun.batch.shell.commands as commands

    real, commands.execute = commands.execute, fake_execute
    try:
        result = runner.invoke(run, ["a.jsonl", "-o", "o.jsonl", "--max-num-seqs", "8",
                                     "--kv-cache-memory", "512MiB", "--no-prefix-cache",
                                     "--temperature", "0", "--tool-parser", "hermes",
                                     "--column", "prompt=text", "--resume"])
    finally:
        commands.execute = real
    assert result.exit_code == 0, result.output
    opts: RunOptions = seen["opts"]
    assert opts.inputs.input == ["a.jsonl"] and opts.inputs.columns == {"prompt": "text"}
    assert opts.engine.scheduler.max_num_seqs == 8
    assert opts.engine.cache.kv_cache_memory == 512 << 20
    assert opts.engine.cache.enable_prefix_caching is False
    assert opts.engine.scheduler.max_num_batched_tokens == 2048  # untouched: the default
    assert opts.defaults.temperature == 0.0 and opts.openai.tool_parser == "hermes"
    assert opts.job.resume is True and opts.job.grace_period == 10.0


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-memory", "2GiBx"], "--kv-cache-memory: could not interpret byte unit"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--tool-parser", "nope"], "--tool-parser"),
])
def test_a_bad_value_is_a_usage_error_naming_the_option(args, message):
    result = CliRunner().invoke(run, ["a.jsonl", "-o", "o.jsonl", *args])
    assert result.exit_code == 2 and message in result.output


def test_job_specs_are_validated_by_the_same_models(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nkv_cache_memory = '
                    '"2GiB"\nprefix_cache = false\nmax_batched_tokens = 512\n')
    opts = load(str(spec))
    assert opts.engine.cache.kv_cache_memory == 2 << 30
    assert opts.engine.cache.enable_prefix_caching is False
    assert opts.engine.scheduler.max_num_batched_tokens == 512
    for table, bad, words in [("[engine]", "max_num_sqs = 8", "unknown key 'max_num_sqs'"),
                              ("[engine]", "dtype = 'float64'", "dtype: Input should be"),
                              ("[defaults]", "temperature = 'hot'", "temperature:"),
                              ("", "resume = 'yes'", "resume: Input should be a valid boolean")]:
        spec.write_text(f'input = "in.jsonl"\noutput = "out.jsonl"\n{table}\n{bad}\n')
        with pytest.raises(JobSpecError) as exc:
            load(str(spec))
        assert str(spec) in str(exc.value) and words in str(exc.value)


def test_a_spec_key_the_command_line_does_not_have_is_unknown(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nnum_blocks = 4\n')
    with pytest.raises(JobSpecError, match="unknown key 'num_blocks'"):
        load(str(spec))


def test_engine_config_default_takes_attribute_or_public_names():
    cfg = EngineConfig.default(num_blocks=64, max_num_batched_tokens=128, prefix_cache=False)
    assert (cfg.cache.num_blocks, cfg.scheduler.max_num_batched_tokens) == (64, 128)
    assert cfg.cache.enable_prefix_caching is False
    with pytest.raises(TypeError, match="unknown key"):
        EngineConfig.default(colour=1)


def test_validate_reports_every_bad_field():
    with pytest.raises(OptionsError) as exc:
        validate_options(ServerOptions, {"port": 70000, "api_key": " k"})
    assert "port:" in str(exc.value) and "api_key:" in str(exc.value)


def test_validate_shares_the_adapter_options():
    options = command_options(validate)
    for f in cli_fields(OpenAIOptions):
        assert f.flag.split("/")[0] in options


def test_seed_default_reaches_requests_that_leave_it_out(smol_tokenizer):
    from batchrun.openai.serving import OpenAIServing, ServingOptions
    from batchrun.served_model import TokenizerModel

    model = TokenizerModel(smol_tokenizer, "m", max_model_len=64)
    serving = OpenAIServing(model, ServingOptions(defaults=RequestDefaults(seed=7)))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert serving.prepare("/v1/chat/completions", body).params.seed == 7
    assert serving.prepare("/v1/chat/completions", {**body, "seed": 3}).params.seed == 3
    result = CliRunner().invoke(run, ["a.jsonl", "-o", "o.jsonl", "--seed", "x"])
    assert result.exit_code == 2 and "--seed" in result.output
