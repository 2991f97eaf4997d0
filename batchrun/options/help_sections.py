"""--help in sections: each generated option carries the section its field declares (or its
model's SECTION), and a command built with SectionedCommand lists its options under those
headings, in SECTIONS' order, one line each: the first sentence of the field's description and
its default. The whole description stays the option's help (the reference is built from it)."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import click

SECTIONS = ("input and output", "model", "engine", "precision", "sampling defaults",
            "reliability", "scale-out", "server", "plan")
OTHER = "other options"

# The end of the first sentence: a full stop before a space, not one of an abbreviation.
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(?=\s|$)")
_DEFAULT = re.compile(r"\[default: [^\]]*\]")


def one_line(text: str) -> str:
    """The first sentence of a help text, with the text's [default: ...] if it came later."""
    text = " ".join(text.split())
    end = _SENTENCE_END.search(text)
    first = text[:end.end()] if end else text
    default = _DEFAULT.search(text[len(first):])
    if default and "[default" not in first:
        first = f"{first} {default.group(0)}"
    return first


class FieldOption(click.Option):
    """A click option generated from an options field: it knows its --help section."""

    def __init__(self, *args: Any, section: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """A command whose --help groups the options by section, one line of help each."""

    FLAGS_WIDTH = 30

    def __init__(self, *args: Any, first: tuple[str, ...] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.first = first  # sections this command lists before SECTIONS' order (serve: server)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:
                continue
            flags, help_text = record
            extras = ""
            if param.help and help_text.startswith(param.help):
                # click's own extras ([required], a range, an env var) follow the help text
                help_text, extras = one_line(param.help), help_text[len(param.help):].strip()
            section = getattr(param, "section", None) or OTHER
            groups.setdefault(section, []).append((flags, help_text, extras))
        known = [*self.first, *(s for s in SECTIONS if s not in self.first)]
        order = [s for s in known if s in groups] + [s for s in groups if s not in known]
        for section in order:
            with formatter.section(section[:1].upper() + section[1:]):
                for flags, help_text, extras in groups[section]:
                    self._write_row(formatter, flags, help_text, extras)

    def _write_row(self, formatter: click.HelpFormatter, flags: str, help_text: str,
                   extras: str) -> None:
        """flags, then the help on one line where the terminal is wide enough (120 columns
        hold every option's), wrapped under itself where it is not."""
        room = max((formatter.width or 80) - formatter.current_indent - self.FLAGS_WIDTH - 2, 30)
        if extras and len(help_text) + 2 + len(extras) <= room:
            help_text = f"{help_text}  {extras}"
        elif "required" in extras:
            help_text = f"{help_text} [required]"
        indent = " " * formatter.current_indent
        pad = indent + " " * (self.FLAGS_WIDTH + 2)
        lines = textwrap.wrap(help_text, room) or [""]
        if len(flags) <= self.FLAGS_WIDTH:
            formatter.write(f"{indent}{flags:<{self.FLAGS_WIDTH}}  {lines[0]}\n")
            lines = lines[1:]
        else:  # a long flag (a list of choices) on its own line, as click does
            formatter.write(f"{indent}{flags}\n")
        for line in lines:
            formatter.write(f"{pad}{line}\n")


class OrderedGroup(click.Group):
    """A group that lists its commands in the order they were added, with their short help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)
