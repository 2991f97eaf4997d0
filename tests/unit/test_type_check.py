"""mypy over all of batchrun/ with pyproject.toml's [tool.mypy] is clean: the contracts between
layers (Protocols, typed results) are checked, not only written down."""

from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]


def test_batchrun_type_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the [tool.mypy] section, and its files = ["batchrun"]
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(tmp_path / "mypy-cache")])
    assert status == 0, out + err
    assert "Success: no issues found" in out
