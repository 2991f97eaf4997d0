"""A folder's safetensors files opened once before anything is built from them: the safetensors
library checks the header (its length, JSON, dtypes, shapes, offsets against the file's size,
overlaps) when a file is opened, so a truncated, lying or damaged file is refused by name
before a byte of the model is allocated, instead of failing (or faulting on a memory-mapped
read past its end) halfway through the load."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from batchrun.models.errors import naming


def check_safetensors(files: Iterable[str | Path]) -> None:
    """ModelFolderError naming the first file the safetensors library cannot open."""
    from safetensors import safe_open

    for f in files:
        with naming(f, "not a readable safetensors file"):
            with safe_open(str(f), framework="pt") as sf:
                sf.keys()
