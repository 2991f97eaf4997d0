"""The sandbox pass_at_k runs model-written programs in, from the harness's side: it starts
the trusted runner (sandbox_runner.py), which starts the launcher (sandbox_launcher.py), which
runs the program; the verdict is the runner's, read from the runner's own stdout.

Two levels, detected once per process (sandbox_level()):

- "namespaced" (Linux, where unprivileged user namespaces are allowed, or as root): the runner
  is PID 1 of fresh user, PID, network, mount, IPC and UTS namespaces (`unshare`). Every
  process the program starts dies with it (setsid and double forks included); it has no
  network but its own loopback; every mount is read-only but its temporary folder; the home
  folders and /tmp are empty tmpfs but for what _kept() binds back; it holds no capability;
  it cannot trace, signal or read the runner; its processes are capped (RLIMIT_NPROC, or as
  root a pids cgroup).
- "process" (anything else, only with unsafe_sandbox = true): the program's process group is
  killed, and on Linux the runner is a child subreaper that kills re-parented descendants too;
  the file system, the network and the user's processes are the program's to use.

Both: a `python -I` process in a fresh temporary folder with a stripped environment, resource
limits (address space, CPU time, file size, open files, processes, no core), a wall-clock
timeout, the pass decided as sandbox_launcher.py says.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GiB = 1 << 30
MiB = 1 << 20
_HERE = Path(__file__).resolve().parent
RUNNER = str(_HERE / "sandbox_runner.py")
LAUNCHER = str(_HERE / "sandbox_launcher.py")
UNSHARE = ["--user", "--map-root-user", "--net", "--mount", "--pid", "--ipc", "--uts",
           "--fork", "--kill-child", "--mount-proc"]
# the sandbox's own tasks in the namespace, counted by RLIMIT_NPROC and pids.max: the runner,
# the launcher and the launcher's program thread
_NAMESPACE_TASKS = 3


# Folders the namespaced program sees empty (but for what _kept() binds back): the user's files
# and credentials (~/.aws, ~/.ssh, ...), other users', and every other program's temp folder.
HIDDEN = sorted({os.path.expanduser("~"), "/root", "/home", "/tmp", "/var/tmp",
                 tempfile.gettempdir()})


def _kept(python: str | None) -> list[str]:
    """What the program needs from the hidden folders: the interpreters (batchrun's and the
    configured one), their packages, the launcher."""
    import site

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(_HERE)}
    given = os.path.abspath(python or sys.executable)
    for interpreter in (given, os.path.realpath(given)):  # a venv's link, and its target
        prefix = os.path.dirname(os.path.dirname(interpreter))
        paths.update((os.path.dirname(interpreter), prefix))
        try:  # a virtualenv: its base interpreter's prefix too
            with open(os.path.join(prefix, "pyvenv.cfg")) as f:
                for line in f:
                    key, _, value = line.partition("=")
                    if key.strip() == "home" and value.strip():
                        paths.add(os.path.dirname(value.strip()))
        except OSError:
            pass
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return sorted(paths)


class SandboxUnavailable(RuntimeError):
    """The namespaced sandbox cannot be had here and unsafe_sandbox is not set."""


@dataclass
class ProgramResult:
    passed: bool
    status: Literal["passed", "failed", "timed out", "out of memory", "killed",
                    "sandbox error"]
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


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")


@functools.lru_cache(maxsize=None)
def pids_cgroup() -> str | None:
    """The pids cgroup folder of this process, where it may create child cgroups (root, a
    cgroup v1 pids hierarchy or a v2 one with the pids controller), else None. RLIMIT_NPROC
    does not bind root (uid 0 outside the namespace): its programs' processes are capped by a
    child cgroup's pids.max instead."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for _, point, fstype, options, *_ in mounts:
        point = _unescape(point)
        if fstype == "cgroup" and "pids" in options.split(","):
            path = next((p for _, c, p in own if "pids" in c.split(",")), None)
        elif fstype == "cgroup2":
            try:
                with open(os.path.join(point, "cgroup.controllers")) as f:
                    if "pids" not in f.read().split():
                        continue
            except OSError:
                continue
            path = next((p for h, _, p in own if h == "0"), None)
        else:
            continue
        if path is not None:
            folder = os.path.join(point, path.lstrip("/"))
            if os.access(folder, os.W_OK):
                return folder
    return None


def _make_cgroup(tasks: int) -> str | None:
    parent = pids_cgroup()
    if parent is None:
        return None
    folder = os.path.join(parent, f"batchrun-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, "pids.max"), "w") as f:
            f.write(str(tasks))
    except OSError:
        _remove_cgroup(folder)
        return None
    return folder


def _remove_cgroup(folder: str | None) -> None:
    for _ in range(200):  # the namespace's last processes may take a moment to be gone
        try:
            if folder is not None and os.path.isdir(folder):
                os.rmdir(folder)
            return
        except OSError:
            time.sleep(0.005)


@functools.lru_cache(maxsize=None)
def sandbox_level() -> tuple[str, str]:
    """("namespaced", why) where the namespaced sandbox holds here (a probe program runs in
    it, cannot write outside its folder and has no network), else ("process", why not)."""
    if not sys.platform.startswith("linux"):
        return "process", f"no namespaces on {sys.platform}"
    if shutil.which("unshare") is None:
        return "process", "util-linux's unshare is not installed"
    probe = ("import socket, os\n"
             "try:\n    open('/probe-write', 'w')\nexcept OSError:\n    pass\n"
             "else:\n    raise SystemExit('the root file system is writable')\n"
             "s = socket.socket()\ns.settimeout(1)\n"
             "try:\n    s.connect(('1.1.1.1', 53))\nexcept OSError:\n    pass\n"
             "else:\n    raise SystemExit('the network is reachable')\n"
             "forked = 0\n"
             "for _ in range(12):\n"
             "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
             "    if pid == 0:\n        os.execv('/bin/sleep', ['sleep', '10'])\n"
             "    forked += 1\n"
             "if forked > 4:\n    raise SystemExit('the process limit does not hold')\n")
    result = _run(probe, namespaced=True, timeout=10.0, memory=GiB, file_size=MiB,
                  processes=4, output_bytes=2000, python=None, site_packages=False)
    if result.passed:
        return "namespaced", "user, PID, network and mount namespaces; read-only mounts"
    return "process", ("the namespaced sandbox does not hold here (unshare --user "
                       "--map-root-user refused, or as root no pids cgroup to cap processes "
                       "with): " + (result.stderr.strip().splitlines() or [result.status])[-1])


def run_program(program: str, *, timeout: float = 10.0, memory: int = GiB,
                file_size: int = 64 * MiB, processes: int = 16, output_bytes: int = 4096,
                python: str | None = None, site_packages: bool = True,
                unsafe_sandbox: bool = False, namespaced: bool | None = None) -> ProgramResult:
    """Run `program` in the sandbox described in the module docstring. memory, file_size:
    bytes; timeout: wall-clock seconds (the CPU limit is ceil(timeout) + 1 s); processes: how
    many processes it may start (0: no RLIMIT_NPROC); site_packages=False runs `python -I -S`
    (the standard library only). SandboxUnavailable where the namespaced sandbox cannot be had,
    unless unsafe_sandbox (then the process-level one runs). namespaced=False: the
    process-level sandbox even where the namespaced one holds (tests)."""
    level, why = sandbox_level()
    if namespaced is False and unsafe_sandbox:
        level = "process"
    if level != "namespaced" and not unsafe_sandbox:
        raise SandboxUnavailable(
            f"pass_at_k needs its namespaced sandbox, which is not available here ({why}); "
            "set unsafe_sandbox = true in the scorer to run programs with process-level "
            "limits only (no file system or network isolation)")
    return _run(program, namespaced=level == "namespaced", timeout=timeout, memory=memory,
                file_size=file_size, processes=processes, output_bytes=output_bytes,
                python=python, site_packages=site_packages)


def _run(program: str, *, namespaced: bool, timeout: float, memory: int, file_size: int,
         processes: int, output_bytes: int, python: str | None,
         site_packages: bool) -> ProgramResult:
    if processes > 0:
        nproc = processes + (_NAMESPACE_TASKS if namespaced else _user_processes() + 2)
    else:
        nproc = 0
    with tempfile.TemporaryDirectory(prefix="batchrun-sandbox-") as tmp:
        root = Path(tmp).resolve()
        (root / "program.py").write_text(program)
        home = root / "home"
        home.mkdir()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home),
               "TMPDIR": str(home), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        cgroup = _make_cgroup(nproc) if nproc and namespaced and os.geteuid() == 0 else None
        config = {"cgroup": cgroup, "hide": HIDDEN, "keep": _kept(python), "dir": str(root), "python": python or sys.executable,
                  "site_packages": site_packages, "launcher": LAUNCHER, "env": env,
                  "namespaced": namespaced, "timeout": timeout, "memory": memory,
                  "cpu": int(math.ceil(timeout)) + 1, "file_size": file_size,
                  "processes": nproc}
        command = [sys.executable, "-I", "-S", RUNNER, json.dumps(config)]
        if namespaced:
            command = [shutil.which("unshare") or "unshare", *UNSHARE, *command]
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=root, env=env,
                                start_new_session=True, close_fds=True)
        try:
            # the runner enforces the timeout itself; this is the backstop where it hangs
            out, err = proc.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            out, err = b"", b"the sandbox's runner did not answer"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            _remove_cgroup(cgroup)
        wall = time.perf_counter() - start
        stdout = _tail(root / ".stdout", output_bytes)
        stderr = _tail(root / ".stderr", output_bytes)
    try:
        verdict = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        verdict = {"passed": False, "returncode": None, "timed_out": False,
                   "error": err.decode("utf-8", "replace").strip()[-500:] or
                   f"the sandbox's runner exited {proc.returncode}"}
    returncode = verdict.get("returncode")
    if verdict.get("passed") is True:
        status = "passed"
    elif verdict.get("error"):
        status, stderr = "sandbox error", f"{stderr}\n{verdict['error']}".strip()
    elif verdict.get("timed_out") or returncode == -signal.SIGXCPU:
        status = "timed out"
    elif "MemoryError" in stderr:
        status = "out of memory"
    elif returncode is not None and returncode < 0:
        status = "killed"
    else:
        status = "failed"
    return ProgramResult(status == "passed", status, returncode, stdout,  # type: ignore[arg-type]
                         stderr, wall)
