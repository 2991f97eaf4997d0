"""reference/cli.md: every command of the `batchrun` CLI and every option, read from the click
commands themselves (the options come from batchrun/options/, so this page follows them)."""

from __future__ import annotations

import inspect

import click

from md import cell, table

from batchrun.options.help_sections import OTHER, SECTIONS


def _commands(group: click.Group, ctx: click.Context, prefix: str):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        path = f"{prefix} {name}"
        yield path, command
        if isinstance(command, click.Group):
            yield from _commands(command, click.Context(command, parent=ctx, info_name=name),
                                 path)


def _value(param: click.Option, ctx: click.Context) -> str:
    """What the option takes: its metavar, or for a number its range (`integer x>=1`)."""
    kind = param.type
    if isinstance(kind, click.types._NumberRangeBase):
        return f"{kind.name.replace(' range', '')} {kind._describe_range()}"
    return param.make_metavar(ctx)


def _option_rows(command: click.Command, ctx: click.Context) -> dict[str, list[list[str]]]:
    groups: dict[str, list[list[str]]] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        flags = " / ".join(", ".join(f"`{o}`" for o in opts)
                           for opts in (param.opts, param.secondary_opts) if opts)
        value = "" if param.is_flag else _value(param, ctx)
        groups.setdefault(getattr(param, "section", None) or OTHER, []).append(
            [flags, value, cell(param.help or "")])
    return groups


def render() -> str:
    from batchrun.cli import main

    root = click.Context(main, info_name="batchrun")
    out = ["# Command line\n",
           "Every command and option of `batchrun`, generated from the commands themselves "
           "when this site is built. `batchrun COMMAND --help` prints the same options, one "
           "line each.\n"]
    for path, command in _commands(main, root, "batchrun"):
        ctx = click.Context(command, parent=root, info_name=path.split()[-1])
        out.append(f"## `{path.strip()}`\n")
        if isinstance(command, click.Group):
            out.append(f"{cell(command.help or '')}\n")
            out.append(table(["command", "what it does"],
                             [[f"`{path} {n}`", command.get_command(ctx, n).get_short_help_str(200)]
                              for n in command.list_commands(ctx)]))
            continue
        pieces = command.collect_usage_pieces(ctx)
        out.append(f"```\n{path} {' '.join(pieces)}\n```\n")
        out.append(inspect.cleandoc(command.help or "") + "\n")
        groups = _option_rows(command, ctx)
        for section in [*SECTIONS, OTHER, *(s for s in groups if s not in SECTIONS + (OTHER,))]:
            if section in groups:
                out.append(f"**{section[:1].upper() + section[1:]}**\n")
                out.append(table(["option", "value", "meaning"], groups[section]))
        if command.epilog:
            out.append("```\n" + command.epilog.replace("\b", "").strip() + "\n```\n")
    return "\n".join(out)
