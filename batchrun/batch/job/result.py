"""What a batch run returns: RunResult, its status and request counts typed, and the metrics
summary exactly as the metrics file holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping


@dataclass(frozen=True)
class RequestCounts:
    """Input lines of the job (earlier attempts' committed lines included): `total` done, of
    which `ok` have a result and `failed` an error record."""

    total: int
    ok: int
    failed: int


@dataclass(frozen=True)
class RunResult:
    status: Literal["completed", "interrupted", "expired", "incomplete"]
    """"interrupted" after a stop: the committed results stay in staging for --resume;
    "expired": the --deadline passed (every line not done has a batch_expired error line);
    "incomplete": the merged output does not hold one record per input line."""

    requests: RequestCounts

    summary: Mapping[str, Any]
    """The metrics summary (batch/job/metrics.py): what the metrics file holds, key for key."""

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> "RunResult":
        """The result a metrics summary describes (this run's, or a completed earlier run's
        metrics file)."""
        r = summary["requests"]
        return cls(summary["status"], RequestCounts(r["total"], r["ok"], r["failed"]), summary)

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def finished(self) -> bool:
        """Every line has a record: completed, or expired (batch_expired error lines)."""
        return self.status in ("completed", "expired")

    @property
    def wall_time_s(self) -> float:
        return self.summary.get("wall_time_s", 0.0)
