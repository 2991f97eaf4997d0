"""SIGKILL at random points, then --resume: nothing lost, nothing repeated (4 trials here,
BATCHRUN_KILL_TRIALS for more; `python -m tests.fault.kill_resume --trials N` alone)."""

import os

from tests.fault.kill_resume import trial

TRIALS = int(os.environ.get("BATCHRUN_KILL_TRIALS", "4"))


def test_kill_and_resume_loses_and_repeats_nothing(tmp_path):
    results = [trial(seed, tmp_path / f"t{seed}") for seed in range(TRIALS)]
    failures = [f"seed {r.seed}: {'; '.join(r.problems)}" for r in results if not r.ok]
    assert not failures, failures
    assert sum(r.lost for r in results) == 0 and sum(r.duplicated for r in results) == 0
    # The trials must actually have killed runs mid-way, not just run them.
    assert sum(r.kills for r in results) >= TRIALS
