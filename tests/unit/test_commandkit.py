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


def test_signals_stop_gracefully_then_at_once_then_raise(caplog):
    stop = StopRequest()
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="batchrun.test"):
        with Signals(stop, log):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.is_set() and not stop.immediate
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.immediate
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before  # the old handlers are back
    assert caplog.messages == ["SIGTERM: stopping (send it again to stop at once)",
                               "SIGINT again: dropping the requests in flight"]


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
