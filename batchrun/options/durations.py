"""Durations and deadlines as people write them: `24h`, `30m`, `1h30m`, `90s`, `2d`, a plain
number of seconds, or (deadlines) an ISO 8601 timestamp."""

from __future__ import annotations

import re
from datetime import datetime

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)([dhms]))+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
MAX_DURATION = 10 * 365 * 86400.0  # ten years: past it a deadline is a mistake (or inf, 1e308)


def parse_duration(text: str) -> float:
    """Seconds; ValueError for what is not a positive duration."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        if not _DURATION.match(text):
            raise ValueError(f"{text!r} is not a duration (e.g. 24h, 30m, 1h30m, 90s)") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    if not seconds > 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    if not seconds <= MAX_DURATION:  # inf and nan fail this too
        raise ValueError(f"{text!r}: a duration must be at most ten years")
    return seconds


def parse_deadline(text: str, now: float) -> float:
    """The deadline as a Unix time: `now` + a duration, or a timestamp (ISO 8601; without a
    UTC offset it is local time)."""
    try:
        return now + parse_duration(text)
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (24h, 30m, 1h30m, 90s) nor an ISO 8601 "
                         "timestamp (2026-12-31T18:00:00Z)") from None
    return stamp.timestamp()
