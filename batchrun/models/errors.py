"""The error a model folder's own files raise when batchrun refuses them, and the context that
turns what a library (transformers, safetensors, gguf, torch.load) raises reading one into it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


class ModelFolderError(ValueError):
    """A file of a model folder batchrun will not load: a config value out of type or range,
    damaged or inconsistent weights, code it would have to run. The message names the file and
    what is wrong; the commands turn it into a usage error (exit 2) before anything is
    allocated."""


@contextlib.contextmanager
def naming(source: str | Path, what: str) -> Iterator[None]:
    """Any Exception raised inside as a ModelFolderError "`source`: `what` (the error)"; a
    ModelFolderError passes as it is. For library calls that read a model's files, whose errors
    (and their tracebacks) name neither the file nor what to do."""
    try:
        yield
    except ModelFolderError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the library raises is about this file
        first = (str(exc).strip().splitlines() or [""])[0]
        if len(first) > 300:
            first = first[:297] + "..."
        raise ModelFolderError(f"{source}: {what} ({type(exc).__name__}: {first})") from exc
