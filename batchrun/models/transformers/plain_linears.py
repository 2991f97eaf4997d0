"""Which of a transformers model's nn.Linear layers must stay nn.Linear: those its modelling code
uses as more than a linear map of one input, where a packed or quantized module in their place
breaks it (PhiMoE's router, an nn.Linear subclass returning routing decisions; HunYuan-MoE's
gate, which reads `self.wg.weight.dtype`). Found in the model, not by name:

- a subclass of nn.Linear with a forward of its own;
- a linear whose `weight` or `bias` the source of the module holding it names
  (`self.wg.weight`), which also covers branches a forward over the probe's tokens skips;
- a linear whose `weight` or `bias` is read other than by its own forward, or that is called
  other than with one positional tensor, during the forward passes traced (the load's probe).
"""

from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

_PARAMS = ("weight", "bias")
_FLAG = "_batchrun_used_directly"  # set on a traced linear's instance dict


def own_forward(linear: nn.Linear) -> bool:
    """Whether `linear` is a subclass of nn.Linear whose forward is not nn.Linear's."""
    return type(linear).forward is not nn.Linear.forward


_SOURCES: dict[type, str] = {}
_TRACED: dict[type, type] = {}


def _source_reads(cls: type) -> str:
    """The source of `cls` and its bases up to torch's own modules ("" where none is found)."""
    if cls in _SOURCES:
        return _SOURCES[cls]
    parts = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):  # a class made at run time, or without a source file
            continue
    _SOURCES[cls] = "\n".join(parts)
    return _SOURCES[cls]


def named_in_source(parent: nn.Module, child: str) -> bool:
    """Whether the source of `parent`'s class reads self.<child>.weight or .bias (an assignment
    to them, as in weight tying, is not a read)."""
    pattern = rf"self\.{re.escape(child)}\.(?:weight|bias)\b(?!\s*=[^=])"
    return re.search(pattern, _source_reads(type(parent))) is not None


def static(model: nn.Module) -> set[str]:
    """Qualified names of the linears that must stay plain by their class or their holder's
    source, without running the model."""
    found = set()
    for path, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and (own_forward(child) or named_in_source(parent, name)):
                found.add(f"{path}.{name}" if path else name)
    return found


class _Traced:
    """Mixed into a linear's class while traced: records a read of its weight or bias from
    outside its own forward, and a call other than with one positional tensor."""

    def __getattr__(self, name: str):
        if name in _PARAMS and not self.__dict__.get("_batchrun_in_forward"):
            self.__dict__[_FLAG] = True
        return super().__getattr__(name)  # type: ignore[misc]

    def forward(self, *args, **kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            self.__dict__[_FLAG] = True
        self.__dict__["_batchrun_in_forward"] = self.__dict__.get("_batchrun_in_forward", 0) + 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_batchrun_in_forward"] -= 1


def _traced_class(cls: type) -> type:
    if cls not in _TRACED:
        _TRACED[cls] = type(f"Traced{cls.__name__}", (_Traced, cls), {})
    return _TRACED[cls]


@contextmanager
def traced(model: nn.Module) -> Iterator[set[str]]:
    """Within: every nn.Linear of `model` traced; on leaving, the set yielded holds the
    qualified names of those used directly meanwhile (their classes restored)."""
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, _Traced)}
    found: set[str] = set()
    for m in linears.values():
        m.__class__ = _traced_class(type(m))
    try:
        yield found
    finally:
        for name, m in linears.items():
            m.__class__ = type(m).__mro__[2]  # (Traced<cls>, _Traced, cls, ...)
            m.__dict__.pop("_batchrun_in_forward", None)
            if m.__dict__.pop(_FLAG, False):
                found.add(name)


def find(model: nn.Module, forward: Callable[[], object]) -> set[str]:
    """Qualified names of `model`'s linears that must stay plain: static's, and those
    forward() (a pass over a few tokens) uses directly."""
    with traced(model) as used:
        forward()
    return static(model) | used
