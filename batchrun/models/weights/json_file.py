"""A model folder's JSON file (config.json, tokenizer_config.json, ...) read as an object, or a
ModelFolderError naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchrun.models.errors import ModelFolderError

# Far above any config's size (the largest real ones are tens of KiB; tokenizer.json, megabytes,
# is read by the tokenizers library, not here).
MAX_BYTES = 64 << 20


def read_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`; ModelFolderError when it is unreadable, not JSON (NaN and
    Infinity included) or not an object."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ModelFolderError(f"{path}: {path.stat().st_size:,} bytes; a model's JSON file "
                                   f"is at most {MAX_BYTES >> 20} MiB")
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, ModelFolderError):
            raise
        raise ModelFolderError(f"{path}: not a readable JSON file ({_reason(exc)})") from None
    if not isinstance(value, dict):
        raise ModelFolderError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return f"{type(exc).__name__}: {exc}"
