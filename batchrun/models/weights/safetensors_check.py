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


def named(files: list, folder: str | Path) -> str:
    """How a message names a checkpoint's files: each of a few, else the folder's pattern."""
    return ", ".join(map(str, files)) if 0 < len(files) <= 3 else f"{folder}/*.safetensors"


def holding(files: Iterable[str | Path], name: str) -> str | None:
    """The file whose header lists tensor `name`."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():
                return str(f)
    return None


def non_float_tensors(files: Iterable[str | Path]) -> list[tuple[str, str, str]]:
    """(file, tensor, dtype) of each integer or boolean tensor in `files` (read from their
    headers): what a float checkpoint does not hold, and transformers would cast silently."""
    from safetensors import safe_open

    found = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                dtype = sf.get_slice(key).get_dtype()
                if dtype.startswith(("I", "U", "BOOL")):
                    found.append((str(f), key, dtype))
    return found
