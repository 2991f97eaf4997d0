"""A model folder's own Python code (transformers' auto_map) runs only under --trust-remote-code,
and nothing asks on stdin (issue 42: `yes y | batchrun models check DIR` ran the folder's code,
and with the batch on stdin transformers' prompt ate its first line and the job exited 0 with
0 requests). The folder's code writes a marker file when it is imported."""

from __future__ import annotations

import builtins
import json

import pytest

from tests.model_folders import CONFIG, LINE, cli, refused, run_on, tiny_folder

CODE = '''
open({marker!r}, "w").write("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"


class TinyCustomModel(LlamaForCausalLM):
    config_class = TinyCustomConfig
'''
AUTO_MAP = {"AutoConfig": "custom.TinyCustomConfig",
            "AutoModelForCausalLM": "custom.TinyCustomModel"}


@pytest.fixture
def no_prompt(monkeypatch):
    """Fails the test if anything asks on stdin."""
    def asked(*args):
        raise AssertionError(f"something asked on stdin: {args}")

    monkeypatch.setattr(builtins, "input", asked)


def custom_folder(tmp_path, where="config.json"):
    """The tiny model with code of its own, named by the auto_map of `where`."""
    folder = tiny_folder(tmp_path / f"custom_{tmp_path.name}")
    marker = tmp_path / "marker"
    (folder / "custom.py").write_text(CODE.format(marker=str(marker)))
    if where == "config.json":
        config = {**CONFIG, "model_type": "tiny_custom", "auto_map": AUTO_MAP}
    else:
        config = json.loads((folder / where).read_text()) if (folder / where).exists() else {}
        config["auto_map"] = {"AutoTokenizer": ["custom.TinyTokenizer", None]} \
            if where == "tokenizer_config.json" else {"AutoProcessor": "custom.TinyProcessor"}
    (folder / where).write_text(json.dumps(config))
    return folder, marker


def test_run_refuses_the_folder_without_reading_stdin(tmp_path, no_prompt):
    folder, marker = custom_folder(tmp_path)
    batch = tmp_path / "stdin.jsonl"  # what a prompt would have read: "y", then the batch
    batch.write_text("y\n" + json.dumps(LINE) + "\n")
    with batch.open("rb") as stdin:
        result = cli("run", "-", "--model", str(folder), "-o", str(tmp_path / "out.jsonl"),
                     input=stdin)
        unread = stdin.tell() == 0
    refused(result, f"{folder}/config.json", "--trust-remote-code")
    assert not marker.exists()
    assert unread  # the input reader had not started; nothing else read it


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json",
                                   "processor_config.json"])
def test_check_plan_and_validate_name_the_file_and_the_flag(tmp_path, no_prompt, where):
    folder, marker = custom_folder(tmp_path, where)
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps(LINE) + "\n")
    for args in (["models", "check", str(folder)], ["plan", str(lines), "--model", str(folder)],
                 ["validate", str(lines), "--check-prompts", "--model", str(folder)]):
        refused(cli(*args, input="y\ny\n"), f"{folder}/{where}", "--trust-remote-code")
    assert not marker.exists()


def test_a_job_spec_names_its_engine_key(tmp_path, no_prompt):
    folder, marker = custom_folder(tmp_path)
    refused(run_on(folder, tmp_path), "trust_remote_code = true")
    assert not marker.exists()


def test_trusted_the_folders_code_runs(tmp_path, no_prompt):
    folder, marker = custom_folder(tmp_path)
    check = cli("models", "check", str(folder), "--trust-remote-code")
    assert check.exit_code == 0, check.output
    assert marker.exists()  # transformers imported the folder's classes
    assert "path: transformers backend" in check.output
    result = run_on(folder, tmp_path, "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200


def test_transformers_raises_instead_of_asking(no_prompt):
    """The belt under the braces: a call into transformers that left trust_remote_code unset
    gets an error, not a prompt."""
    from transformers.dynamic_module_utils import resolve_trust_remote_code

    from batchrun.models.weights.remote_code import never_prompt

    never_prompt()
    with pytest.raises(ValueError, match="trust_remote_code"):
        resolve_trust_remote_code(None, "some/model", has_local_code=False, has_remote_code=True)
