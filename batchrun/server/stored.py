"""The server's JSON state files (batch objects, file objects): written atomically, read back
at startup.

A file that cannot be one of ours (truncated, not JSON, the wrong shape, or named for another
id) is renamed aside to `<name>.corrupt` with a warning, so one bad file costs its own object
instead of the server's start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import orjson

from batchrun.batch.storage.io import atomic_local_file

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace `path` with `obj` as JSON; a crash leaves the old object or the new one."""
    with atomic_local_file(path) as f:
        f.write(json.dumps(obj).encode())


def load_objects(root: Path, pattern: str, fields: Mapping[str, type | tuple[type, ...]],
                 allowed: dict[str, tuple] | None = None) -> Iterator[dict]:
    """The objects in root/pattern whose `fields` have the given types, whose `allowed` fields
    have one of the listed values, and whose id is the file name's stem; the others are
    quarantined."""
    for path in sorted(root.glob(pattern)):
        try:
            obj = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            quarantine(path, f"unreadable: {exc}")
            continue
        problem = _shape_problem(obj, fields, allowed or {})
        if problem is None and obj["id"] != path.stem:
            problem = f"its id {obj['id']!r} is not its file name's"
        if problem is not None:
            quarantine(path, problem)
            continue
        yield obj


def _shape_problem(obj, fields: Mapping[str, type | tuple[type, ...]], allowed: dict) -> str | None:
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    for name, types in fields.items():
        if name not in obj:
            return f"no {name!r}"
        if not isinstance(obj[name], types):
            return f"{name!r} is a {type(obj[name]).__name__}"
    for name, values in allowed.items():
        if obj.get(name) not in values:
            return f"{name!r} is {obj.get(name)!r}"
    return None


def quarantine(path: Path, reason: str) -> None:
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt.{n}")
        n += 1
    try:
        os.replace(path, target)
    except OSError as exc:
        log.warning("ignoring %s (%s); could not move it aside: %s", path, reason, exc)
        return
    log.warning("ignoring %s (%s); moved it to %s", path, reason, target.name)
