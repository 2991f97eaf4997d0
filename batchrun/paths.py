"""Where batchrun keeps what it builds once per machine (converted models, compiled kernels).

Imports nothing of batchrun, so the engine's kernels and the model loader can both use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """$BATCHRUN_CACHE, else the user's cache folder for batchrun."""
    env = os.environ.get("BATCHRUN_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("batchrun"))
