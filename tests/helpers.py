"""What several test modules share: the CLI as a subprocess on the fake engine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_ENGINE_ENV = dict(os.environ, BATCHRUN_TEST_ENGINE="tests.fake_engine:load",
                       PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def batchrun(*args, input=None, env=None, timeout=120):
    """`python -m batchrun ARGS...` from the repository root, on the fake engine."""
    return subprocess.run([sys.executable, "-m", "batchrun", *map(str, args)], cwd=ROOT,
                          env={**FAKE_ENGINE_ENV, **(env or {})}, input=input,
                          capture_output=True, timeout=timeout)
