"""The grid: every combination of the axes' values is one cell."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Cell:
    id: str  # c001, c002, ... in grid order
    settings: tuple[tuple[str, Any], ...]  # (axis, value) in the grid's axis order

    @property
    def model(self) -> str:
        return str(dict(self.settings).get("model", DEFAULT_MODEL))

    @property
    def prompt(self) -> str:
        """The prompt variant's name ("" without variants)."""
        return str(dict(self.settings).get("prompt", ""))

    @property
    def sampling(self) -> dict[str, Any]:
        """The request fields this cell sets (everything but model and prompt)."""
        return {k: v for k, v in self.settings if k not in ("model", "prompt")}

    @property
    def n(self) -> int:
        return int(dict(self.settings).get("n", 1) or 1)

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings) or "(defaults)"


def cells(grid: dict[str, Any]) -> list[Cell]:
    """`grid`: axis -> list of values (prompt: name -> template, its names are the values)."""
    axes = list(grid)
    values = [list(grid[a]) if a == "prompt" else grid[a] for a in axes]
    out = []
    for number, combo in enumerate(itertools.product(*values), start=1):
        out.append(Cell(f"c{number:03d}", tuple(zip(axes, combo))))
    return out


def axes(grid: dict[str, Any]) -> list[str]:
    """The grid's axes as table columns (model always: the results name their model)."""
    return (["model"] if "model" not in grid else []) + list(grid)
