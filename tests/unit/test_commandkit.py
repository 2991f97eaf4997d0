"""The commands' shared plumbing (batchrun/commandkit.py): signals of a resumable run, the
interrupt exit, the Ray loader wrapping."""

import logging
import os
import signal

import pytest

from batchrun.batch.job.loop import StopRequest
from batchrun.commandkit import EXIT_INTERRUPTED, INTERRUPTED, Signals, interrupted, on_ray
from batchrun.options.ray import RayOptions

log = logging.getLogger("batchrun.test")


def test_signals_stop_gracefully_then_at_once(caplog):
    stop = StopRequest()
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="batchrun.test"):
        with Signals(stop, log):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.is_set() and not stop.immediate
            with pytest.raises(KeyboardInterrupt):  # the second ends the run at once
                os.kill(os.getpid(), signal.SIGINT)
            assert stop.immediate
    assert signal.getsignal(signal.SIGTERM) is before  # the old handlers are back
    assert caplog.messages == ["SIGTERM: stopping (send it again to stop at once)",
                               "SIGINT again: stopping at once; what finished is committed"]


def test_a_run_that_does_not_wind_down_is_stopped_by_the_watchdog(monkeypatch, caplog):
    """After the first signal the main thread stays busy (here: blocked on an event nobody
    sets); past the grace period and the wind-down allowance it is stopped at once."""
    import threading
    import time

    from batchrun import commandkit

    monkeypatch.setattr(commandkit, "WIND_DOWN_S", 0.3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="batchrun.test"):
        with Signals(StopRequest(), log, grace=0.2):
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(KeyboardInterrupt):
                threading.Event().wait(30)
    assert 0.4 < time.monotonic() - started < 5
    assert "still running 0 s after the signal: stopping at once" in caplog.text


def test_a_second_sigterm_ends_a_run_stuck_in_a_step_and_keeps_what_finished(tmp_path):
    """The engine's step hangs for a minute after three steps; SIGTERM twice ends the process
    at once (75) and the lines done stay committed for --resume."""
    import json
    import subprocess
    import sys
    import time

    from tests.helpers import ENV, ROOT

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 1}}) for i in range(8)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    stuck = ("from batchrun.cli import main; from tests.fake_engine import FakeEngine, fake_model;"
             " main(obj={'load_model': lambda m, c: fake_model(FakeEngine(step_s=0.05, slow_after=3, "
             "slow_step_s=60, record=False), name=m or 'smollm2-135m')})")
    proc = subprocess.Popen([sys.executable, "-c", stuck, "run", str(src), "-o", str(out),
                             "--max-in-flight", "2", "--commit-interval", "0.01", "--progress",
                             "none"], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    staging = tmp_path / "out.jsonl.batchrun-staging"
    deadline = time.monotonic() + 60
    while not list(staging.glob("part-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # in the hanging step now
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75
    assert time.monotonic() - sent < 5
    err = proc.stderr.read()
    assert "stopping at once; what finished is committed" in err and "Traceback" not in err
    from batchrun.batch.job.staging import Staging

    assert Staging(str(staging)).scan().count >= 2  # the lines done before the hang, kept


def test_interrupted_says_how_to_go_on(caplog):
    with caplog.at_level(logging.WARNING, logger="batchrun.test"):
        assert interrupted(log) == EXIT_INTERRUPTED == 75
    assert caplog.messages == [INTERRUPTED] and "--resume" in INTERRUPTED


def test_on_ray_wraps_the_loader_only_with_ray():
    def load(model, engine_config):
        return "local"

    assert on_ray(RayOptions(), load) is load
    on_cluster = on_ray(RayOptions(ray=True), load)  # starts nothing until it is called
    assert on_cluster is not load and on_cluster.__qualname__.startswith("ray_loader")
