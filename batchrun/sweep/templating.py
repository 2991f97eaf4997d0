"""The Jinja environment a sweep's prompts render in: Jinja's sandbox (no attribute of Python
internals, no unsafe callables), StrictUndefined (a missing column is an error, not ""), and
limits on what one render may cost: RENDER_SECONDS of wall time (checked at every call,
attribute or item lookup, filter, loop step over range() and output chunk), RENDER_CHARS of
output, ranges of at most MAX_RANGE items, and no integer operand above MAX_OPERAND to `*`,
`**`, `%` or a filter (the ways one expression can allocate gigabytes). render() turns any
failure (an error of the template, a TypeError of the row's values, a limit) into RenderError,
which the sweep records as that row's error.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from typing import Any, Callable

import jinja2
import jinja2.sandbox

RENDER_SECONDS = 2.0
RENDER_CHARS = 4 << 20
MAX_RANGE = 100_000
MAX_OPERAND = 1 << 20


class RenderError(ValueError):
    """A prompt that cannot be rendered for a row (the message says why)."""


class _Deadline:
    def __init__(self) -> None:
        self.at = time.monotonic() + RENDER_SECONDS

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise RenderError(f"rendering took over {RENDER_SECONDS:g} s")


def _big_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OPERAND


_WIDE = re.compile(r"\d{%d,}" % len(str(MAX_OPERAND)))  # a width or precision in a format


def _wide_format(value: Any) -> bool:
    return isinstance(value, str) and _WIDE.search(value) is not None


class BoundedEnvironment(jinja2.sandbox.SandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals["range"] = self._range
        self.filters = {name: self._bounded(name, f) for name, f in self.filters.items()}
        self._local = threading.local()  # the deadline of the render on this thread

    def _tick(self) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            deadline.check()

    def _range(self, *args: int):
        span = range(*args)
        if len(span) > MAX_RANGE:
            raise RenderError(f"range() of {len(span)} items (at most {MAX_RANGE})")
        for value in span:
            self._tick()
            yield value

    def _bounded(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        # compiled templates call filters directly, not through call_filter
        first = 1 if getattr(function, "jinja_pass_arg", None) else 0

        @functools.wraps(function)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._tick()
            value, rest = args[first:first + 1], [*args[first + 1:], *kwargs.values()]
            if any(_big_int(v) for v in rest) or name == "format" and \
                    any(_wide_format(v) for v in value):
                raise RenderError(f"an argument of the {name!r} filter over {MAX_OPERAND}")
            return function(*args, **kwargs)

        return bounded

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        __self._tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._tick()
        if attribute in ("format", "format_map") and _wide_format(obj):
            raise RenderError(f"a width over {MAX_OPERAND} in a format string")
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._tick()
        operands = [left, right] + (list(right) if isinstance(right, (tuple, list)) else [])
        if operator == "**" and _big_int(right) or operator != "**" and \
                any(_big_int(v) for v in operands) or operator == "%" and _wide_format(left):
            raise RenderError(f"an operand of {operator!r} over {MAX_OPERAND}")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 8 * MAX_OPERAND:
            raise RenderError(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)

    def render(self, template: jinja2.Template, row: dict[str, Any]) -> str:
        """The template's output for `row`, within the limits (RenderError otherwise)."""
        deadline = self._local.deadline = _Deadline()
        try:
            chunks, size = [], 0
            for chunk in template.generate(**row):
                size += len(chunk)
                if size > RENDER_CHARS:
                    raise RenderError(f"the output passed {RENDER_CHARS} characters")
                deadline.check()
                chunks.append(chunk)
            return "".join(chunks)
        except RenderError:
            raise
        except jinja2.TemplateError as exc:
            raise RenderError(f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a row's values meet the template's operators
            raise RenderError(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._local.deadline = None
