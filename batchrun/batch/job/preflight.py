"""Checks on where a job writes, made before any model loads: nothing the operator did not ask
for is overwritten, an input is never an output, and every local location is writable.

Raises ValueError (the runner's usage error, exit code 2) naming the path.
"""

from __future__ import annotations

import os
from typing import Any

from batchrun.batch.storage import io


def check_outputs(where: Any, job: Any, storage: Any, input_paths: list[str]) -> None:
    """`where`: the plan's Targets (output, errors, metrics, staging); `job`: JobOptions."""
    targets = [("output", where.output), ("error file", where.errors),
               ("metrics file", where.metrics), ("staging folder", where.staging)]
    targets = [(what, path) for what, path in targets if path and path != io.STDIO]
    inputs = {_identity(p) for p in input_paths if p != io.STDIO}
    for what, path in targets:
        if _identity(path) in inputs:
            raise ValueError(f"the {what} {path} is also an input: the results would replace "
                             "it; choose another -o")
    for what, path in targets:
        if io.is_local(path):
            _check_writable(what, io.local_path(path), is_dir=what == "staging folder")
    if not (job.overwrite or job.restart):
        for what, path in targets[:2]:
            if storage.exists(path) and not _belongs_to_job(where, storage, input_paths):
                raise ValueError(
                    f"the {what} {path} already exists and is not this job's result (no "
                    f"completed run over {_names(input_paths)} and no interrupted one made it); "
                    "pass --overwrite to replace it")


def _identity(path: str) -> str:
    if io.is_local(path):
        return os.path.realpath(io.local_path(path))
    return path.rstrip("/")


def _check_writable(what: str, path: str, is_dir: bool) -> None:
    """Try it: open an existing file for appending (changing nothing), or create and remove a
    probe file in the folder that will hold the new entry. Permission bits alone would not do:
    root ignores them, a read-only mount does not."""
    if os.path.exists(path) and is_dir != os.path.isdir(path):
        raise ValueError(f"the {what} {path} is {'a file' if is_dir else 'a folder'}")
    if os.path.isfile(path):
        _try(what, path, lambda: os.close(os.open(path, os.O_WRONLY | os.O_APPEND)))
    folder = path if is_dir and os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the {what} {path}: {folder} is not a folder")
    probe = os.path.join(folder, f".batchrun-probe-{os.getpid()}")

    def create_and_remove():
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    _try(what, path, create_and_remove, folder)


def _try(what: str, path: str, action, folder: str | None = None) -> None:
    try:
        action()
    except OSError as exc:
        where = f" ({folder} is not writable)" if folder and folder != path else ""
        raise ValueError(f"cannot write the {what} {path}{where}: {exc.strerror}") from None


def _belongs_to_job(where: Any, storage: Any, input_paths: list[str]) -> bool:
    """An existing output is this job's when the metrics beside it record a completed run over
    the same input paths (their content may have changed since: a nightly job over a refreshed
    file), or when the staging folder holds an interrupted run of this job over them."""
    names = [_identity(p) for p in input_paths]
    if where.metrics:
        try:
            old = storage.read_json(where.metrics)
        except (OSError, ValueError):
            old = None
        if (isinstance(old, dict) and old.get("status") == "completed"
                and old.get("output") == where.output
                and [_identity(i[0]) for i in old.get("input_fingerprint") or []] == names):
            return True
    if where.staging:
        from batchrun.batch.job.staging import Staging, StagingError

        staging = Staging(where.staging, storage)
        try:
            manifest = staging.manifest() if staging.exists() else None
        except (OSError, ValueError, StagingError):
            manifest = None
        if (manifest is not None and manifest.get("output") == where.output
                and [_identity(i[0]) for i in manifest.get("inputs") or []] == names):
            return True
    return False


def _names(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
