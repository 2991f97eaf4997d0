"""`batchrun models check`'s exit code for what is not a model (2, as its help and `run` say),
and its weight memory: the bytes a loaded model holds, as `batchrun plan` counts them, with the
logits' packed copy of tied embeddings named (issue 43: check said 513.1 MiB where plan said
621.1 MiB for the bundled model)."""

import json
import re

from click.testing import CliRunner

from batchrun.batch.shell.commands import plan
from batchrun.models_cli import models
from tests.helpers import held_bytes
from tests.tiny_models import make_tiny

SAMPLE = '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", ' \
    '"body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}\n'


def test_a_folder_that_is_not_a_model_is_a_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    for where in (tmp_path, tmp_path / "missing"):
        result = CliRunner().invoke(models, ["check", str(where)])
        assert result.exit_code == 2, result.output
        assert str(where) in result.output and "Traceback" not in result.output


def test_check_and_plan_count_the_same_held_weights(tmp_path, smol_tokenizer, monkeypatch):
    from batchrun import llm
    from batchrun.batch.estimate import calibrate, throughput
    from batchrun.options.engine import EngineConfig

    folder = tmp_path / "tied"
    make_tiny("llama", folder, vocab_size=len(smol_tokenizer), tie_word_embeddings=True)
    smol_tokenizer.save_pretrained(folder)
    check = CliRunner().invoke(models, ["check", str(folder)])
    assert check.exit_code == 0, check.output
    held = held_bytes(llm.load_from_path(folder, EngineConfig.default(
        device="cpu", dtype="float32", kv_cache_memory=1 << 20)).engine.runner.model)
    said = re.search(r"weights held when run here \(as `batchrun plan` counts them\): "
                     r"float32 ([\d.]+) MiB.*packed copy of the tied embeddings \(([\d.]+) MiB",
                     check.output)
    assert said, check.output
    assert float(said.group(1)) == round(held / 2**20, 1)
    hidden, vocab = 128, len(smol_tokenizer)
    assert float(said.group(2)) == round(vocab * hidden * 4 / 2**20, 1)

    monkeypatch.setattr(calibrate, "calibrate", lambda cfg, engine: throughput.prior(cfg))
    src = tmp_path / "in.jsonl"
    src.write_text(SAMPLE)
    args = [str(src), "--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "1MiB"]
    got = json.loads(CliRunner().invoke(plan, [*args, "--json"]).stdout)
    assert got["weights_bytes"] == held
    assert got["tied_logits_copy_bytes"] == vocab * hidden * 4
    text = CliRunner().invoke(plan, args).stdout
    assert "of it the logits' packed copy of the tied embeddings" in text
