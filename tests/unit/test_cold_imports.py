"""What a cold start imports (speed itself is measured by scripts, not asserted here): `batchrun
--help` no torch; loading a model for `run` no transformers, FastAPI or torch._dynamo."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATCHRUN_DISABLE_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys\n"
                          "print(json.dumps(sorted(sys.modules)))"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(modules: set[str], *names: str) -> list[str]:
    return [n for n in names if n in modules]


def test_help_imports_no_torch():
    code = ("from batchrun.cli import main\ntry:\n    main(['run', '--help'], prog_name='batchrun')\n"
            "except SystemExit:\n    pass")
    assert _heavy(_modules(code), "torch", "transformers", "fastapi") == []


def test_loading_the_bundled_model_imports_no_transformers():
    """Once its load check's reference is cached (models/native_check.py: the first load on a
    machine computes it with transformers)."""
    code = ("from batchrun.commandkit import load_model\nfrom batchrun.batch.job import loop, runner\n"
            "m = load_model(None, None)\nassert m.tokenizer.eos_token_id == 2")
    _modules(code)  # the first load on this machine: the reference computed and cached
    assert _heavy(_modules(code), "transformers", "fastapi", "uvicorn", "torch._dynamo") == []
