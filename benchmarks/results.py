"""One system's figures in a throughput run: what bench.py measures in process and cli_run.py
reads back from a `batchrun run` subprocess."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Result:
    system: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    outputs: list[list[int]]
    cache_hit_rate: float | None = None
    peak_rss_mib: float | None = None  # the process's peak while this system ran
    texts: list[str] | None = None  # the outputs as text (what a CLI run's file holds)
    timers: dict[str, float] | None = None  # benchmarks/step_timers.py seconds
    steps: int | None = None  # engine steps
    process_seconds: float | None = None  # a CLI run: the whole process, start-up included

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def trim(row: list[int], limit: int, eos_id: int) -> list[int]:
    """A generated row as every system's output is counted: at most `limit` tokens, ending at
    (and counting) the first EOS."""
    row = list(row[:limit])
    return row[:row.index(eos_id) + 1] if eos_id in row else row
