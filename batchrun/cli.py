"""Command line: assembles the commands, nothing else (nothing imports this module).

    batchrun run | validate | job | plan   batch/shell/commands.py
    batchrun sweep [report]                sweep/commands.py
    batchrun serve                         server/cli.py
    batchrun models ...                    models_cli.py

Exit codes of a run are in batch/shell/launch.py (0 ok, 1 crash, 2 usage, 3 too many failed
lines, 4 deadline passed, 75 interrupted). torch and transformers are imported inside
commands so `batchrun --help` stays fast. A caller may inject the model loader (tests: a fake engine) as
`main(obj={"load_model": loader})`.
"""

from __future__ import annotations

import logging
import sys

import click

from batchrun import __version__
from batchrun.batch.shell.commands import COMMANDS
from batchrun.models_cli import models
from batchrun.options.help_sections import OrderedGroup
from batchrun.server.cli import serve
from batchrun.sweep.commands import sweep


@click.group(cls=OrderedGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, message="%(prog)s %(version)s")
def main() -> None:
    """Run OpenAI Batch files through a local continuous-batching LLM engine."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


for command in (*COMMANDS, sweep, serve, models):
    main.add_command(command)
