"""Jinja environments whose renders are bounded: a sweep's prompts (sweep/dataset.py, with
StrictUndefined: a missing column is an error, not "") and chat templates
(models/text/chat_template.py, immutable like transformers'). Jinja's sandbox (no attribute of
Python internals, no unsafe callables) plus limits on what one render may cost: RENDER_SECONDS
of wall time (checked at every call, attribute or item lookup, filter, loop step over range()
and output chunk), RENDER_CHARS of output (or the environment's own `chars`), ranges of at
most MAX_RANGE items, no integer operand above MAX_OPERAND to `*`, `**`, `%` or a filter, and
no string or list repeated past RENDER_CHARS items (the ways one expression can allocate
gigabytes). Every render, `env.render(template, row)` or a compiled template's own
`render(...)`, turns any failure (an error of the template, a TypeError of the values, a
limit) into RenderError, which the caller records as that row's or line's error.
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


def _long_repeat(operator: str, left: Any, right: Any) -> bool:
    """`'x' * n` or `[..] * n` whose result would pass RENDER_CHARS items."""
    if operator != "*":
        return False
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                len(seq) * times > RENDER_CHARS:
            return True
    return False


class _Range:
    """range() for templates: a sequence like range's whose iteration checks the deadline."""

    def __init__(self, span: range, tick: Callable[[], None]):
        self.span, self.tick = span, tick

    def __iter__(self):
        for value in self.span:
            self.tick()
            yield value

    def __reversed__(self):
        return iter(_Range(self.span[::-1], self.tick))

    def __len__(self) -> int:
        return len(self.span)

    def __getitem__(self, index: Any) -> Any:
        item = self.span[index]
        return _Range(item, self.tick) if isinstance(item, range) else item

    def __contains__(self, value: Any) -> bool:
        return value in self.span


class BoundedTemplate(jinja2.Template):
    """A template whose own render() is the environment's bounded one."""

    environment: "BoundedEnvironment"

    def render(self, *args: Any, **kwargs: Any) -> str:
        return self.environment.render(self, dict(*args, **kwargs))


class BoundedEnvironment(jinja2.sandbox.SandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})
    template_class = BoundedTemplate

    def __init__(self, chars: int | None = None, wrap_errors: bool = True,
                 **options: Any) -> None:
        """`chars`: the output limit of this environment's renders [RENDER_CHARS].
        `wrap_errors=False`: the template's own errors propagate as they are (a chat
        template's raise_exception is a TemplateError, as in transformers); only a limit is
        a RenderError."""
        super().__init__(**options)
        self.chars, self.wrap_errors = chars, wrap_errors
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals["range"] = self._range
        self.filters = {name: self._bounded(name, f) for name, f in self.filters.items()}
        self._local = threading.local()  # the deadline of the render on this thread

    def _tick(self) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            deadline.check()

    def _range(self, *args: int) -> _Range:
        span = range(*args)
        if len(span) > MAX_RANGE:
            raise RenderError(f"range() of {len(span)} items (at most {MAX_RANGE})")
        return _Range(span, self._tick)

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
        if _long_repeat(operator, left, right):
            raise RenderError(f"a repetition of more than {RENDER_CHARS} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 8 * MAX_OPERAND:
            raise RenderError(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)

    def render(self, template: jinja2.Template, row: dict[str, Any]) -> str:
        """The template's output for `row`, within the limits (RenderError otherwise)."""
        deadline = self._local.deadline = _Deadline()
        limit = self.chars or RENDER_CHARS
        try:
            chunks, size = [], 0
            for chunk in template.generate(**row):
                size += len(chunk)
                if size > limit:
                    raise RenderError(f"the output passed {limit} characters")
                deadline.check()
                chunks.append(chunk)
            return "".join(chunks)
        except RenderError:
            raise
        except Exception as exc:  # noqa: BLE001 - a row's values meet the template's operators
            if not self.wrap_errors:
                raise
            raise RenderError(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._local.deadline = None


class ImmutableBoundedEnvironment(BoundedEnvironment, jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The bounded environment that also refuses to modify lists and dicts in place, as the
    environment transformers renders chat templates in does."""
