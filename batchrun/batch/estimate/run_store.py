"""The recent completed runs of each model on this machine, kept for `batchrun plan`'s
calibration: one JSON file per model and machine (CPU model, cores, torch threads, GPU), so a
run on another machine never calibrates this one. The file keeps the last KEEP runs, newest
first: a small run after a large one must not push the large one out (plan calibrates only on
runs that did enough work, batch/estimate/confidence.py)."""

from __future__ import annotations

import json
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping


def machine_info() -> dict[str, Any]:
    """What a calibration depends on: CPU model, cores, torch threads, GPU if any."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_key(info: dict[str, Any] | None = None) -> str:
    import hashlib

    info = info or machine_info()
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:12]


def runs_dir() -> Path:
    """$BATCHRUN_RUNS_DIR (the test suite points it elsewhere), else <cache>/runs."""
    from batchrun.paths import cache_dir

    env = os.environ.get("BATCHRUN_RUNS_DIR")
    return Path(env) if env else cache_dir() / "runs"


def _run_path(model_key: str, info: dict[str, Any] | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_key).strip("_") or "model"
    return runs_dir() / f"{safe[:80]}--{machine_key(info)}.json"


KEEP = 8  # runs kept per model and machine


def save_run(summary: Mapping[str, Any], model_key: str) -> Path:
    """Add `summary` (a run's metrics) to the recent runs of model_key on this machine."""
    info = machine_info()
    path = _run_path(model_key, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": model_key, "machine": info,
              "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "summary": summary}
    runs = [record] + load_runs(model_key, info)[:KEEP - 1]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"model": model_key, "machine": info, "runs": runs}, default=str))
    os.replace(tmp, path)
    return path


def load_runs(model_key: str, info: dict[str, Any] | None = None) -> list[dict]:
    """The records save_run kept for model_key on this machine ({"summary", "machine",
    "saved_at", "model"} each), newest first; [] for none, another machine's, unreadable."""
    info = info or machine_info()
    try:
        stored = json.loads(_run_path(model_key, info).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(stored, dict) or stored.get("machine") != info:
        return []
    # A file written before runs were kept as a list holds one record.
    runs = stored.get("runs") if "runs" in stored else [stored]
    return [r for r in runs if isinstance(r, dict) and isinstance(r.get("summary"), dict)] \
        if isinstance(runs, list) else []
