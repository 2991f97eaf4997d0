"""Markdown pieces the reference generators share."""

from __future__ import annotations

import types
import typing
from typing import Any


def cell(text: Any) -> str:
    """Text fit for one table cell: one line, pipes escaped."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def type_name(annotation: Any) -> str:
    """A pydantic annotation as a reader spells it: `int | None`, `"a" | "b"`, list[str]."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: Any) -> str:
    """A pydantic field's default as the reference shows it."""
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    if default is None or default == {} or default == []:
        return ""
    return f"`{default}`"
