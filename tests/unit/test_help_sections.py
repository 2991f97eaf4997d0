"""--help in sections: `batchrun run --help` lists every option under the section its field
declares (options/help_sections.py), one line of help each on a 120-column terminal, and
`batchrun --help` lists the commands one line each."""

import re

import pytest
from click.testing import CliRunner

from batchrun.batch.shell.commands import run
from batchrun.cli import main
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import public_fields
from batchrun.options.help_sections import SECTIONS, one_line
from batchrun.options.job import InputOptions, JobOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.ray import RayOptions

RUN_MODELS = (JobOptions, InputOptions, EngineConfig, OpenAIOptions, RequestDefaults, RayOptions)
HEADING = re.compile(r"^([A-Z][a-z -]+):$")


def help_text(*args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    return result.output


def sections_of(text: str) -> dict[str, list[str]]:
    """heading (lower case) -> the lines under it."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        heading = HEADING.match(line)
        if heading:
            current = out.setdefault(heading.group(1).lower(), [])
        elif current is not None and line.strip():
            current.append(line)
    return out


def test_run_help_lists_each_option_once_under_its_fields_section_in_order():
    text = help_text("run")
    sections = sections_of(text)
    expected_order = [s for s in SECTIONS if s != "server" and s != "plan"]
    assert [s for s in sections if s in SECTIONS] == expected_order
    fields = [f for m in RUN_MODELS for f in public_fields(m) if f.extra.get("cli", True)]
    assert len(fields) > 50
    for f in fields:
        flag = f.flag.split("/")[0]
        starts = [(name, line) for name, lines in sections.items() for line in lines
                  if re.match(rf"  (-\w, )?{re.escape(flag)}[ /]", line + " ")]
        assert len(starts) == 1, (flag, starts)
        assert starts[0][0] == f.section, (flag, starts[0][0], f.section)
    # a section a field declares is one --help shows
    assert {f.section for f in fields} <= set(SECTIONS)


@pytest.mark.parametrize("command", ["run", "plan", "validate", "serve"])
def test_every_option_gets_one_line_of_help_at_120_columns(command):
    lines = help_text(command).splitlines()
    assert max(len(line) for line in lines) <= 120
    continuation = " " * 34
    checked = 0
    for i, line in enumerate(lines):
        if not re.match(r"  (-\w, )?--", line):
            continue
        # the help follows the flags on their line, or (after a long list of choices) has the
        # next line to itself; either way the line after it is not more of it
        help_line = i if re.search(r"\S {2,}\S", line.strip()) else i + 1
        assert lines[help_line].strip(), line
        after = lines[help_line + 1] if help_line + 1 < len(lines) else ""
        assert not (after.startswith(continuation) and after.strip()), (line, after)
        checked += 1
    assert checked > 15


def test_a_commands_own_section_comes_first():
    assert list(sections_of(help_text("validate")))[0] == "validate"
    assert list(sections_of(help_text("plan")))[0] == "plan"
    assert list(sections_of(help_text("serve")))[0] == "server"


def test_the_first_sentence_is_the_line_and_a_later_default_is_kept():
    assert one_line("Seconds a fetch may take. Retried after a 429.") == \
        "Seconds a fetch may take."
    assert one_line("KV cache size, e.g. 2GiB [default: 4GiB]. More text.") == \
        "KV cache size, e.g. 2GiB [default: 4GiB]."
    assert one_line("Where results go. Under -o -, a folder [default: <output>.staging].") == \
        "Where results go. [default: <output>.staging]"
    assert one_line("Progress as a bar\n   or as log lines") == "Progress as a bar or as log lines"


def test_the_full_description_stays_the_options_help_for_the_reference():
    params = {p.name: p for p in run.params}
    assert params["quantization"].help.startswith(
        EngineConfig.model_fields["device"].annotation.model_fields["quantization"].description)
    assert "int8-weight / int4-weight" in params["quantization"].help


def test_batchrun_help_lists_the_commands_in_order_one_line_each():
    text = help_text()
    lines = sections_of(text)["commands"]
    names = [line.split()[0] for line in lines]
    assert names == ["run", "validate", "job", "plan", "sweep", "serve", "models"]
    for line, name in zip(lines, names):
        command = main.commands[name]
        shown = line.split(None, 1)[1]
        assert shown == command.short_help or shown == command.get_short_help_str(120), line
        assert not shown.endswith("..."), f"{name}'s line is cut: {shown}"
