"""The adapters of one engine: every registered one checked at start-up, up to max_loras of
them resident (their weights on the model's device, each in a slot), the others loaded on
demand when a request needs them, the least recently used resident one evicted.

Implements batchrun.engine.lora.AdapterSlots. A load that fails at run time (the file changed
or went away since start-up) is remembered: requests for that adapter end with its error, the
others are unaffected.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Collection, Sequence

import torch
from torch import nn

from batchrun.models.lora.adapter import LoraError, read_adapter
from batchrun.models.lora.layers import (StepAdapters, projection_updates, projections_of,
                                         wrap_projections)
from batchrun.models.lora.targets import LoraTargets

log = logging.getLogger(__name__)


def lora_targets(model: nn.Module) -> LoraTargets:
    """What adapters may target on `model` (its `lora_targets()`); LoraError when it has none."""
    declared = getattr(model, "lora_targets", None)
    if declared is None:
        raise LoraError(f"LoRA is not supported on {type(model).__name__}")
    try:
        return declared()
    except ValueError as exc:
        raise LoraError(f"LoRA is not supported on this model: {exc}") from exc


class LoraManager:
    def __init__(self, model: nn.Module, adapters: dict[str, str], max_loras: int,
                 max_lora_rank: int, device: torch.device, dtype: torch.dtype,
                 base_names: Collection[str] = ()):
        """Checks every adapter (config and weight header, against the base's shapes) and loads
        the first max_loras; LoraError for the first bad one."""
        self.model, self.paths = model, dict(adapters)
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        clash = sorted(set(adapters) & set(base_names))
        if clash:
            raise LoraError(f"LoRA adapter name {clash[0]!r} is the base model's name")
        self.targets = lora_targets(model)
        self.step = StepAdapters()
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.failed: dict[str, str] = {}
        modules: set[tuple[int, str]] = set()
        for name, path in self.paths.items():
            modules |= read_adapter(name, path, self.targets, max_lora_rank, weights=False).where
        wrap_projections(self.targets, projections_of(self.targets, modules), self.step)
        for name in list(self.paths)[:max_loras]:
            self._load(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def known(self, name: str) -> bool:
        return name in self.paths

    def slot_of(self, name: str) -> int:
        return self.resident[name]

    def activate(self, names: Collection[str]) -> dict[str, str]:
        errors: dict[str, str] = {}
        needed = set(names)
        assert len(needed) <= self.max_loras, "more adapters in flight than --max-loras"
        for name in needed:
            if name in self.failed:
                errors[name] = self.failed[name]
            elif name in self.resident:
                self.resident.move_to_end(name)
            else:
                try:
                    self._load(name, keep=needed)
                except LoraError as exc:
                    log.error("%s", exc)
                    self.failed[name] = errors[name] = str(exc)
        return errors

    def set_segments(self, segments: Sequence[tuple[int, int, int]]) -> None:
        self.step.segments = list(segments)

    def _load(self, name: str, keep: Collection[str] = ()) -> None:
        adapter = read_adapter(name, self.paths[name], self.targets, self.max_rank)
        updates = projection_updates(adapter.weights, adapter.scaling, self.targets,
                                     self.device, self.dtype)
        if len(self.resident) >= self.max_loras:
            victim = next(n for n in self.resident if n not in keep)
            slot = self.resident.pop(victim)
            log.info("LoRA adapter %s evicted for %s", victim, name)
        else:
            slot = min(set(range(self.max_loras)) - set(self.resident.values()))
        self.step.updates[slot] = updates
        self.resident[name] = slot
        log.info("LoRA adapter %s loaded (rank %d, %s) into slot %d", name, adapter.rank,
                 ", ".join(adapter.modules), slot)
