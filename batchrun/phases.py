"""Start-up phase timings: `batchrun run --log-level debug` logs how long each phase of a cold
start took (imports, planning, weights, tokenizer, kernels, the first engine step), each from
the end of the one before and from the process's start. Imports nothing of batchrun.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("batchrun.startup")


def _process_start() -> float:
    """The process's start on time.monotonic()'s clock where Linux says when it started
    (interpreter start-up and imports then count), else now."""
    now = time.monotonic()
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        age = since_boot - start_ticks / os.sysconf("SC_CLK_TCK")
        return now - age if 0 <= age < 3600 else now
    except (OSError, ValueError, IndexError, AttributeError):
        return now


_START = _process_start()
_last = _START
_seen: set[str] = set()


def mark(phase: str, once: bool = False) -> float:
    """Log `phase` as done now (debug level): its own seconds and the seconds since the
    process started. `once`: only the first time this phase is marked. The phase's seconds."""
    global _last
    if once and phase in _seen:
        return 0.0
    _seen.add(phase)
    now = time.monotonic()
    took, _last = now - _last, now
    log.debug("%-34s %6.2f s  (%.2f s since the process started)", phase, took, now - _START)
    return took
