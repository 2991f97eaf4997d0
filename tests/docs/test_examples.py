"""Every command and JSON example in the docs and the README is checked: each `batchrun ...`
command is parsed by the real CLI (its options come from the options schema, so a misspelt
option, a bad choice or a wrong type fails), the ones whose inputs ship with the repository run
on the fake engine, each JSON line is validated by batchrun's own request and result models and
the openai package's types, and each TOML spec is loaded as a job or sweep spec."""

import json
import os
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from openai.types.chat import ChatCompletion

from batchrun.batch.shell.jobspec import load as load_job_spec
from batchrun.cli import main
from batchrun.openai.wire import BatchOutputLine, ErrorBody, parse_batch_line
from batchrun.sweep.spec import load as load_sweep_spec
from tests.docs.conftest import ROOT
from tests.fake_engine import load as fake_load

PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# Repository folders a runnable example may read from (run in a scratch copy of the checkout's
# layout, so outputs land in the test's own folder).
SHIPPED = ("sample_data", "sweeps", "jobs", "batchrun")
RUNNABLE = {"run": 0, "validate": None, "job": 0}  # command -> expected exit (None: 0 or 3)


def blocks(kind: str):
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == kind:
                line = text[:m.start()].count("\n") + 2
                yield f"{page.relative_to(ROOT)}:{line}", m.group(2)


def commands():
    """(where, argv) of every `batchrun` command in a bash block (a pipeline's batchrun part,
    comments and redirections left out)."""
    for where, body in blocks("bash"):
        for offset, line in enumerate(body.replace("\\\n", " ").splitlines()):
            line = line.split(" #")[0]
            for part in re.split(r"[|;&]|&&", line):
                words = shlex.split(part.split(">")[0]) if "batchrun " in part else []
                if words and words[0] == "batchrun":
                    yield f"{where}+{offset}", words[1:]


COMMANDS = list(commands())


def parse(argv: list[str]) -> click.Context:
    """Resolve and parse a command line as the CLI would, without running it."""
    ctx = main.make_context("batchrun", list(argv))
    group, args = main, [*ctx._protected_args, *ctx.args]
    while args:
        name, command, args = group.resolve_command(ctx, args)
        ctx = command.make_context(name, args, parent=ctx)
        if not isinstance(command, click.Group):
            return ctx
        group, args = command, [*ctx._protected_args, *ctx.args]
    return ctx


def test_the_docs_have_examples_to_check():
    assert len(COMMANDS) > 40
    assert {argv[0] for _, argv in COMMANDS} >= {"run", "validate", "plan", "job", "sweep",
                                                 "serve", "models"}


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses(where, argv):
    try:
        parse(argv)
    except click.exceptions.Exit:
        pass  # --help
    except click.ClickException as exc:
        pytest.fail(f"{where}: batchrun {' '.join(argv)}: {exc.format_message()}")


def runnable(argv: list[str]) -> bool:
    if argv[0] not in RUNNABLE or "--ray" in argv or "--check-prompts" in argv:
        return False  # Ray and the real tokenizer are other tests' subject (and cost seconds)
    inputs = [a for a in argv[1:] if not a.startswith("-") and "/" in a and "=" not in a]
    return bool(inputs) and all((ROOT / a).exists() for a in inputs[:1]) and \
        inputs[0].split("/")[0] in SHIPPED


RUNS = [(w, a) for w, a in COMMANDS if runnable(a)]


@pytest.mark.parametrize("where,argv", RUNS, ids=[w for w, _ in RUNS])
def test_documented_commands_on_shipped_files_run_on_the_fake_engine(where, argv, tmp_path,
                                                                     monkeypatch):
    for name in SHIPPED:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, argv, obj={"load_model": fake_load},
                                env={"COLUMNS": "120"})
    expected = RUNNABLE[argv[0]]
    ok = (0, 3) if expected is None else (expected,)
    assert result.exit_code in ok, f"{where}: {result.output[-2000:]}"


JSON = [(where, line) for where, body in blocks("json") for line in body.splitlines()
        if line.strip()]


def test_the_docs_have_json_examples():
    assert len(JSON) >= 10


@pytest.mark.parametrize("where,text", JSON, ids=[w for w, _ in JSON])
def test_every_json_example_is_a_valid_line(where, text):
    obj = json.loads(text)
    if "method" in obj:  # a batch input line: the run's own parser and the endpoint's model
        parse_batch_line(text, 1)
        return
    assert set(obj) == {"id", "custom_id", "response", "error"}, where
    line = BatchOutputLine.model_validate(obj)
    if line.response is None:
        assert line.error is not None and line.error.code, where
    elif line.response.status_code == 200:
        assert line.error is None
        if line.response.body.get("object") == "chat.completion":
            ChatCompletion.model_validate(line.response.body)
    else:
        ErrorBody.model_validate(line.response.body["error"])


TOML = list(blocks("toml"))


@pytest.mark.parametrize("where,text", TOML, ids=[w for w, _ in TOML])
def test_every_toml_example_loads_as_a_spec(where, text, tmp_path):
    (tmp_path / "sample_data").symlink_to(ROOT / "sample_data")
    spec = tmp_path / "specs" / "example.toml"
    spec.parent.mkdir()
    spec.write_text(text)
    if "[dataset]" in text:
        load_sweep_spec(str(spec))
        return
    # a fragment (a few keys a guide shows) is checked inside the smallest whole spec
    for key, value in (("output", "out.jsonl"), ("input", "../sample_data/chat.jsonl")):
        if not re.search(rf"^{key}\s*=", text, re.M):
            text = f'{key} = "{value}"\n' + text
    spec.write_text(text)
    load_job_spec(str(spec), {"date": "2024-06-01"})
