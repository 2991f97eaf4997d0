"""--kv-cache-dtype: from the CLI and job specs down to the KV pool the engine allocates."""

import torch
from click.testing import CliRunner

from batchrun.batch.shell.jobspec import load
from batchrun.cli import main
from batchrun.engine import SamplingParams
from tests.helpers import tiny_engine


def test_cli_offers_and_checks_the_option(tmp_path):
    runner = CliRunner()
    for command in ("run", "serve"):
        assert "--kv-cache-dtype" in runner.invoke(main, [command, "--help"]).output
    bad = runner.invoke(main, ["run", str(tmp_path / "in.jsonl"), "--kv-cache-dtype", "int4"])
    assert bad.exit_code == 2 and "int4" in bad.output


def test_job_spec_sets_it(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nkv_cache_dtype = "float16"\n')
    assert load(str(spec), {}).engine.cache.kv_cache_dtype == "float16"


def test_engine_allocates_and_uses_a_16_bit_pool(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, kv_cache_dtype="bfloat16")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in engine.runner.kv_caches)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
