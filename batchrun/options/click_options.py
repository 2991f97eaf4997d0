"""Click options generated from the options models: one per public field, its type, choices,
range and help text taken from the field's declaration. Every option defaults to None (unset),
so what the user did not give keeps the model's default, shown in --help."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

import annotated_types
import click
from pydantic import BaseModel, ByteSize

from batchrun.options.fields import PublicField, public_fields
from batchrun.options.help_sections import FieldOption


def _inner(annotation: Any) -> Any:
    """X from `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _bounds(info: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            out["min"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            out.update(min=m.gt, min_open=True)
        elif isinstance(m, annotated_types.Le):
            out["max"] = m.le
        elif isinstance(m, annotated_types.Lt):
            out.update(max=m.lt, max_open=True)
    return out


def _json_object(ctx, param, value):
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object")
    return parsed


def pairs(ctx, param, values):
    """NAME=VALUE, repeatable -> {NAME: VALUE}."""
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r}: use NAME=VALUE")
        out[key.strip()] = val.strip()
    return out or None


def _default_text(info: Any) -> str | None:
    if info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    if default is None or default is False or default == {} or default == []:
        return None
    if isinstance(default, Path):
        return str(default)
    return str(default)


def _help(f: PublicField) -> str:
    text = f.info.description or ""
    shown = _default_text(f.info)
    if shown is not None and "[default" not in text and _inner(f.info.annotation) is not bool:
        text += f" [default: {shown}]"
    return text


def click_option(f: PublicField, required: bool = True) -> Callable:
    info, extra = f.info, f.extra
    kind = _inner(info.annotation)
    names = [f.flag] + ([extra["short"]] if extra.get("short") else [])
    kw: dict[str, Any] = {"default": None, "help": _help(f), "show_default": False,
                          "cls": FieldOption, "section": f.section}
    if info.is_required() and required:
        kw["required"] = True
    if extra.get("metavar"):
        kw["metavar"] = extra["metavar"]
    if extra.get("envvar"):
        kw.update(envvar=extra["envvar"], show_envvar=True)
    if kind is bool:
        if info.get_default() is not False:  # on by default, or unset (None): both spellings
            names = [f"{f.flag}/--no-{f.flag[2:]}"]
        else:
            kw["is_flag"] = True
    elif typing.get_origin(kind) is Literal:
        kw["type"] = click.Choice([str(v) for v in typing.get_args(kind)])
    elif kind is int:
        kw["type"] = click.IntRange(**_bounds(info)) if _bounds(info) else int
    elif kind is float:
        kw["type"] = click.FloatRange(**_bounds(info)) if _bounds(info) else float
    elif kind is ByteSize:
        kw.setdefault("metavar", "SIZE")
    elif kind is Path:
        kw["type"] = click.Path(path_type=Path)
    elif typing.get_origin(kind) is dict and typing.get_args(kind) == (str, str):
        kw.update(multiple=True, callback=pairs, default=())
    elif kind is dict or typing.get_origin(kind) is dict:
        kw.update(callback=_json_object, metavar=kw.get("metavar", "JSON"))
    elif typing.get_origin(kind) is list:
        kw.update(multiple=True, default=())
    return click.option(*names, f.name, **kw)


def click_options(*models: type[BaseModel], only: tuple[str, ...] | None = None,
                  optional: tuple[str, ...] = ()) -> Callable:
    """Decorate a command with the CLI options of `models` (or `only` these of them), in
    declaration order; `optional`: required fields this command can do without."""
    fields = [f for m in models for f in public_fields(m)
              if f.extra.get("cli", True) and (only is None or f.name in only)]
    seen: set[str] = set()
    for f in fields:
        if f.name in seen:
            raise TypeError(f"option {f.name!r} is declared twice")
        seen.add(f.name)

    def decorate(command: Callable) -> Callable:
        for f in reversed(fields):
            command = click_option(f, required=f.name not in optional)(command)
        return command
    return decorate
