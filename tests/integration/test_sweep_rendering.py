"""Sweep prompts that fail to render are that row's error, within time and size limits; a spec
whose scorer or template cannot work is a usage error (exit 2) naming the key. Through the CLI
on the fake engine (tests/fake_batchrun.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import polars as pl
import pytest

from batchrun import templating
from batchrun.templating import BoundedEnvironment, RenderError

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"id": 1, "question": "a", "hint": "h"}, {"id": 2, "question": "b", "hint": None}]


def sweep(tmp_path: Path, prompt: str, scorer: str = 'type = "contains"') -> tuple:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "r"\noutput = "out"\n[dataset]\npath = "d.jsonl"\nid = "id"\n'
                    f'reference = "question"\nprompt = {json.dumps(prompt)}\n[grid]\n'
                    f'max_tokens = [3]\n[[scorers]]\n{scorer}\n')
    done = subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "sweep", str(spec)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    results = tmp_path / "out" / "results.parquet"
    rows = pl.read_parquet(results).sort("id").to_dicts() if results.exists() else []
    return done, rows


def test_a_row_whose_values_break_the_template_is_that_rows_error(tmp_path):
    done, rows = sweep(tmp_path, "{{ question + hint }}")
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in rows] == ["1", "2"]
    assert rows[0]["error"] is None and rows[0]["score:contains"] is not None
    assert "cannot be rendered" in rows[1]["error"] and "TypeError" in rows[1]["error"]
    assert "Traceback" not in done.stderr and "first error: c001/2" in done.stderr


def test_a_runaway_loop_is_every_rows_error_not_a_crash(tmp_path):
    start = time.monotonic()
    done, rows = sweep(tmp_path, "{% for i in range(100000000) %}x{% endfor %}{{ question }}")
    assert done.returncode == 0, done.stderr
    assert len(rows) == 2 and all("range() of 100000000 items" in r["error"] for r in rows)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("scorer, words", [
    ('type = "python"\nfunction = "missing.py:score"', ["scorers[0] (python)", "missing.py"]),
    ('type = "python"\nfunction = "json:nope"', ["scorers[0] (python)", "'nope'"]),
])
def test_a_scorer_that_cannot_load_is_a_usage_error_naming_the_key(tmp_path, scorer, words):
    done, _ = sweep(tmp_path, "{{ question }}", scorer)
    assert done.returncode == 2, done.stderr
    assert all(w in done.stderr for w in words), done.stderr
    assert "Traceback" not in done.stderr


def test_a_template_that_does_not_parse_is_a_usage_error(tmp_path):
    done, _ = sweep(tmp_path, "{{ question + }}")
    assert done.returncode == 2 and "not a valid template" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# --- the limits, on the environment itself -----------------------------------------------

ENV = BoundedEnvironment(undefined=jinja2.StrictUndefined)


def render(source: str, **row) -> str:
    return ENV.render(ENV.from_string(source), row)


@pytest.mark.parametrize("source, words", [
    ("{{ 'x' * 10**9 }}", "operand of '*'"),
    ("{{ 'x' | center(10**9) }}", "'center' filter"),
    ("{{ '%1000000000s' % 1 }}", "operand of '%'"),
    ("{{ '{:>1000000000}'.format(1) }}", "width over"),
    ("{{ 7 ** 100000000 }}", "operand of '**'"),
    ("{{ (10 ** 1000) ** 100000 }}", "too large"),
    ("{% for i in range(10**9) %}{% endfor %}", "range() of"),
    ("{{ lipsum(10**6) }}", "'lipsum' is undefined"),
    ("{{ nope }}", "UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
])
def test_expressions_that_would_allocate_or_escape_are_refused(source, words):
    with pytest.raises(RenderError, match=re.escape(words)):
        render(source)


def test_time_and_output_size_are_bounded(monkeypatch):
    monkeypatch.setattr(templating, "RENDER_SECONDS", 0.3)
    start = time.monotonic()
    with pytest.raises(RenderError, match="took over 0.3 s"):
        render("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    assert time.monotonic() - start < 2
    monkeypatch.setattr(templating, "RENDER_CHARS", 1000)
    with pytest.raises(RenderError, match="passed 1000 characters"):
        render("{% for i in range(5000) %}{{ q }}{% endfor %}", q="ab")
    assert render("{% for i in range(3) %}{{ q }}{% endfor %} {{ n * 2 }}", q="ab", n=21) == \
        "ababab 42"


def test_pass_at_k_where_its_sandbox_cannot_hold_stops_the_sweep(tmp_path, monkeypatch):
    from batchrun.sweep.run import run_sweep
    from batchrun.sweep.scorers import code as code_scorer
    from batchrun.sweep.spec import SpecError, load

    monkeypatch.setattr(code_scorer, "sandbox_level", lambda: ("process", "no user namespaces"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "def f():\\n", "test": "def check(f): pass",'
                                      ' "entry_point": "f"}\n')
    spec = tmp_path / "s.toml"
    spec.write_text('name = "p"\noutput = "out"\n[dataset]\npath = "d.jsonl"\n'
                    'prompt = "{{ prompt }}"\nendpoint = "completions"\n[[scorers]]\n'
                    'type = "pass_at_k"\n')

    def never(*args):
        raise AssertionError("the model must not load")

    parsed, text = load(str(spec))
    with pytest.raises(SpecError, match=r"scorers\[0\] \(pass_at_k\).*no user namespaces.*"
                                        r"unsafe_sandbox = true"):
        run_sweep(parsed, text, never)
    spec.write_text(spec.read_text() + "unsafe_sandbox = true\n")
    parsed, text = load(str(spec))
    assert parsed.scorers[0].unsafe_sandbox is True


def test_messages_sent_to_the_completions_endpoint_are_a_usage_error(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = tmp_path / "s.toml"
    spec.write_text('name = "m"\noutput = "out"\n[dataset]\npath = "d.jsonl"\nid = "id"\n'
                    'endpoint = "completions"\nmessages = [{role = "user", content = '
                    '"{{ question }}"}]\nreference = "question"\n[[scorers]]\ntype = "contains"\n')
    done = subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "sweep", str(spec)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "sends a text prompt" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
