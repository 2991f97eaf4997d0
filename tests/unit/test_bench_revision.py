"""The bench's batchrun-run@REV system runs a git revision's package, not this checkout's."""

import os
import subprocess
import sys

import pytest

from benchmarks import cli_run, machine
from tests.helpers import kernel_library


def test_package_at_extracts_the_revisions_package_and_it_imports_first(tmp_path):
    if subprocess.run(["git", "-C", str(cli_run.ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode:
        pytest.skip("not a git checkout")
    code = cli_run.package_at("HEAD", tmp_path / "code")
    committed = subprocess.run(["git", "-C", str(cli_run.ROOT), "show", "HEAD:batchrun/llm.py"],
                               check=True, capture_output=True, text=True).stdout
    assert (code / "batchrun" / "llm.py").read_text() == committed
    assert not (code / "tests").exists() and not (code / "benchmarks").exists()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(cli_run.ROOT)])}
    # As run_cli starts it: a script (its folder first on sys.path), from the checkout's root.
    script = tmp_path / "where.py"
    script.write_text("import batchrun, benchmarks; print(batchrun.__file__); print(benchmarks.__file__)")
    where = subprocess.run([sys.executable, str(script)], cwd=cli_run.ROOT, env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    assert where[0] == str(code / "batchrun" / "__init__.py")
    assert where[1] == str(cli_run.ROOT / "benchmarks" / "__init__.py")


def test_isa_cap_note_names_the_caps_in_force(monkeypatch):
    for key in machine.ISA_CAPS["avx2"]:
        monkeypatch.delenv(key, raising=False)
    assert machine.isa_cap_note() == ""
    for key, value in machine.ISA_CAPS["avx2"].items():
        monkeypatch.setenv(key, value)
    assert machine.isa_cap_note().startswith(", instruction set capped at avx2 (")


def test_an_older_revisions_kernels_are_built_under_the_cap(tmp_path, monkeypatch):
    """A revision that predates BATCHRUN_SIMD gets the cap from the compiler wrapper instead."""
    from batchrun.engine import kernels

    if kernel_library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "real-cache"))
    (tmp_path / "real-cache" / "models").mkdir(parents=True)
    monkeypatch.setenv("BATCHRUN_SIMD", "portable")
    env = cli_run.capped_kernels_env(tmp_path)
    assert (tmp_path / "cache" / "models").resolve() == tmp_path / "real-cache" / "models"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("BATCHRUN_SIMD")  # what an older revision does: no cap of its own
    lib = kernels.library(("-DNO_SPECIALISED", "-DCAPPED_COMPILER_TEST"))
    assert kernels.SIMD_PATHS[lib.simd_path()] == "portable"
    assert list((tmp_path / "cache" / "kernels").glob("*.so"))
    monkeypatch.delenv("BATCHRUN_SIMD", raising=False)
    assert cli_run.capped_kernels_env(tmp_path / "none") == {}
