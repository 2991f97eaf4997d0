"""int8 gives the same bits on every ISA path oneDNN can take on this machine.

The machine's own best path (AMX-INT8 where the CPU has it) runs in this process; AVX512-VNNI
(where the machine has more: AMX) and AVX2, whose saturating int16 products the load-time
check must catch (the float emulation runs instead), each in a subprocess
(tests/int8_paths.py) with oneDNN capped by ONEDNN_MAX_CPU_ISA. The int32
sums are exact on every path, so smoothed layers at decode and prefill row counts, and a tiny
calibrated model's greedy tokens and logprobs, must agree to the bit: a kernel that is inexact
on some CPU kind changes them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchrun.models.quant.cpu import cpu_flags
from tests import int8_paths

ROOT = Path(__file__).resolve().parents[2]
VNNI_CAP, AVX2_CAP = "AVX512_CORE_VNNI", "AVX2"


def _capped_run(cap: str) -> dict:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
    done = subprocess.run([sys.executable, "-m", "tests.int8_paths"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("oneDNN is capped for the whole run: the native path is not this CPU's")
    out = {"native": int8_paths.probe(tmp_path_factory.mktemp("int8"))}
    if "amx_int8" in cpu_flags():  # below AMX, VNNI is the native path already
        out["vnni"] = _capped_run(VNNI_CAP)
    out["avx2"] = _capped_run(AVX2_CAP)
    return out


def test_every_isa_path_computes_the_same_int8_bits(runs):
    native = runs["native"]
    assert len(native["layers"]) == 12 and len(native["tokens"]) == 3
    for name, run in runs.items():
        assert run["layers"] == native["layers"], f"{name}: smoothed int8 layers differ"
        assert run["tokens"] == native["tokens"], f"{name}: greedy tokens differ"
        assert run["logprobs"] == native["logprobs"], f"{name}: logprobs differ"


def test_the_load_check_catches_avx2s_saturating_products(runs):
    assert runs["avx2"]["exact"] is False  # vpmaddubsw saturates: emulated instead
    if {"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags():
        assert all(run["exact"] for name, run in runs.items() if name != "avx2")
