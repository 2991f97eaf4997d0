"""The pass_at_k sandbox as an attacker meets it: a program must not pass without its tests
passing, must not outlive its run, write outside its folder, reach the network or fork without
bound. Honest programs keep passing (tests/unit/test_sweep_scorers.py, and the HumanEval
agreement in tests/integration/test_sweep.py)."""

from __future__ import annotations

import os
import socket
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from batchrun.sweep.scorers import build, run_program
from batchrun.sweep.scorers import code as code_scorer
from batchrun.sweep.scorers import sandbox
from batchrun.sweep.scorers.sandbox import sandbox_level

NAMESPACED = sandbox_level()[0] == "namespaced"
needs_namespaces = pytest.mark.skipif(not NAMESPACED, reason=sandbox_level()[1])


def fails_after(attack: str) -> str:
    """The attack, then a test that fails: only a forged verdict passes it."""
    return textwrap.dedent(attack) + "\nassert False, 'the tests ran and failed'\n"


FORGERIES = {
    # the probe's attack: the token from __main__ (and every frame up the stack), written
    # wherever a verdict might be read, then exit 0 before the tests
    "token from __main__ and the frames": """
        import __main__, os, sys
        found = [v for v in vars(__main__).values() if isinstance(v, (str, bytes))]
        frame = sys._getframe()
        while frame is not None:
            found += [v for v in frame.f_locals.values() if isinstance(v, (str, bytes))]
            frame = frame.f_back
        tokens = [v for v in found if len(v) in (16, 32)]  # a token's length, raw or in hex
        for value in tokens[:1]:
            data = value if isinstance(value, bytes) else value.encode()
            open(".status", "wb").write(data)
            for fd in range(3, 64):
                try:
                    os.write(fd, data)
                except OSError:
                    pass
        os._exit(0)
    """,
    "a P on every pipe, then exit 0": """
        import os
        for fd in range(3, 64):
            try:
                os.write(fd, b"P")
            except OSError:
                pass
        os._exit(0)
    """,
    "a P on every pipe, then the failure goes to /dev/null": """
        import os
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in range(3, 64):
            try:
                os.write(fd, b"P")
                os.dup2(null, fd)
            except OSError:
                pass
    """,
    "16-byte objects from gc": """
        import gc, os
        for obj in gc.get_objects():
            pass
    """,
    "the launcher's frame": """
        import sys
        frames = sys._current_frames()
    """,
    "the launcher's memory": """
        with open("/proc/self/mem", "rb") as f:
            f.read(1)
    """,
    "the launcher's memory through a link": """
        import os
        os.symlink("/proc/self/mem", "m")
        open("m", "rb")
    """,
    "the launcher's memory through a link opened relative to a folder": """
        import os
        os.mkdir("d")
        os.symlink("/dev/fd/../mem", "d/m")
        folder = os.open("d", os.O_RDONLY | os.O_DIRECTORY)
        os.read(os.open("m", os.O_RDONLY, dir_fd=folder), 1)
    """,
    "the launcher's memory through its /proc folder": """
        import os
        folder = os.open("/dev/fd/..", os.O_RDONLY | os.O_DIRECTORY)
        for name in os.listdir(folder):
            if name.startswith("m") and name.endswith("m"):
                os.read(os.open(name, os.O_RDONLY, dir_fd=folder), 1)
    """,
    "ctypes": """
        import ctypes
        ctypes.string_at(id(object()), 16)
    """,
    "a trace function that skips the assert": """
        import sys
        sys.settrace(lambda *a: None)
    """,
    "builtins and os rebound": """
        import builtins, os
        builtins.BaseException = int
        builtins.isinstance = lambda *a: True
        os._exit = lambda code: None
        os.write = lambda fd, data: 1
    """,
    "a thread that writes P after the failure": """
        import os, threading, time
        def later():
            time.sleep(0.2)
            for fd in range(3, 64):
                try:
                    os.write(fd, b"P")
                except OSError:
                    pass
        threading.Thread(target=later).start()
    """,
    "an exception hook": """
        import sys, threading, os
        def hook(*a):
            for fd in range(3, 64):
                try:
                    os.write(fd, b"P")
                except OSError:
                    pass
        sys.excepthook = sys.unraisablehook = threading.excepthook = hook
    """,
    "SIGINT to the launcher": """
        import _thread, time
        _thread.interrupt_main()
        time.sleep(0.2)
    """,
}


LEVELS = [pytest.param(True, id="namespaced", marks=needs_namespaces),
          pytest.param(False, id="process level")]


@pytest.mark.parametrize("namespaced", LEVELS)
@pytest.mark.parametrize("attack", list(FORGERIES), ids=list(FORGERIES))
def test_a_program_cannot_forge_its_pass(attack, namespaced):
    result = run_program(fails_after(FORGERIES[attack]), timeout=5, unsafe_sandbox=True,
                         namespaced=namespaced)
    assert not result.passed, result
    assert result.status in ("failed", "killed"), result


REACHING_THE_TOKEN = [k for k in FORGERIES if k.startswith(("16-byte", "the launcher's", "ctypes",
                                                            "a trace"))]


@pytest.mark.parametrize("attack", REACHING_THE_TOKEN, ids=REACHING_THE_TOKEN)
def test_the_ways_to_the_launchers_token_are_refused(attack):
    # without the failing test: the access itself must fail, not only the forged verdict
    result = run_program(textwrap.dedent(FORGERIES[attack]), timeout=5, unsafe_sandbox=True)
    assert not result.passed and "the sandbox refuses" in result.stderr, result


@pytest.mark.parametrize("namespaced", LEVELS)
def test_honest_programs_with_threads_and_collections_pass(namespaced):
    assert run_program("import gc, threading\ngc.collect()\nt = threading.Thread(target=print)"
                       "\nt.start(); t.join()\n", unsafe_sandbox=True,
                       namespaced=namespaced).passed


def test_honest_programs_importing_data_libraries_pass():
    # pandas starts a native thread of its own, warnings and dataclasses walk frames,
    # numpy loads ctypes: none of it is the program reaching for the token
    pytest.importorskip("pandas")
    result = run_program("import warnings, dataclasses, typing, numpy, pandas\n"
                         "warnings.warn('x')\n@dataclasses.dataclass\nclass P:\n    x: int\n"
                         "class Q(typing.NamedTuple):\n    a: int\n"
                         "assert pandas.Series([1, 2]).sum() == 3\n", timeout=30,
                         unsafe_sandbox=True)
    assert result.passed, result


def _alive(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


ESCAPEE = """
import os, subprocess, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # {marker}"],
                         start_new_session=True)
        os._exit(0)
    os._exit(0)
os.wait()
import time
time.sleep(0.5)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")
@pytest.mark.parametrize("namespaced", LEVELS)
def test_a_double_forked_setsid_escapee_dies_with_the_program(namespaced):
    marker = f"escapee-{uuid.uuid4().hex}"
    result = run_program(ESCAPEE.format(marker=marker), timeout=5, unsafe_sandbox=True,
                         namespaced=namespaced)
    assert result.passed, result
    deadline = time.monotonic() + 2
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(marker) == []


@needs_namespaces
def test_the_file_system_is_read_only_outside_the_programs_folder(tmp_path):
    outside = tmp_path / "written-from-the-sandbox"
    repo_file = os.path.join(os.path.dirname(__file__), f"sandbox-{uuid.uuid4().hex}")
    program = textwrap.dedent(f"""
        import os
        open("mine.txt", "w").write("x")  # its own folder is writable
        assert open("mine.txt").read() == "x"
        for path in ({str(outside)!r}, "/etc/batchrun-sandbox-test", {str(repo_file)!r}):
            try:
                open(path, "w")
            except OSError as exc:
                assert exc.errno in (30, 2), exc  # EROFS; ENOENT in a hidden folder
            else:
                raise SystemExit("wrote " + path)
        print(open("/etc/passwd").read()[:4])  # reading is allowed
    """)
    result = run_program(program)
    assert result.passed, result
    assert not outside.exists() and not os.path.exists(repo_file)


@needs_namespaces
def test_the_users_files_and_other_temp_folders_are_hidden(tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("hunter2")
    home = os.path.expanduser("~")
    program = textwrap.dedent(f"""
        import os, sys
        assert not os.path.exists({str(secret)!r})
        print(sorted(os.listdir(os.path.dirname(os.getcwd()))), os.path.basename(os.getcwd()))
        print(sorted(os.listdir({home!r})))
        import json  # the interpreter and its packages are still there
    """)
    result = run_program(program)
    assert result.passed, result
    *_, beside, visible = result.stdout.strip().splitlines()
    kept = sandbox._kept(None)

    def kept_below(folder: str) -> set[str]:  # the interpreter and its packages stay visible
        return {os.path.relpath(p, folder).split(os.sep)[0] for p in kept
                if p.startswith(folder + os.sep)}
    names, own = beside.rsplit(" ", 1)
    assert set(eval(names)) <= {own} | kept_below(tempfile.gettempdir())
    assert set(eval(visible)) <= kept_below(home)
    assert secret.read_text() == "hunter2"


@needs_namespaces
def test_there_is_no_network_and_no_capability():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    program = textwrap.dedent(f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1)
        except OSError:
            pass
        else:
            raise SystemExit("reached the host's loopback")
        caps = [l for l in open("/proc/self/status") if l.startswith(("CapEff", "CapBnd"))]
        assert all(int(l.split()[1], 16) == 0 for l in caps), caps
    """)
    try:
        result = run_program(program, timeout=5)
    finally:
        waiter.join()
        server.close()
    assert result.passed, result
    assert accepted == []


@needs_namespaces
def test_a_fork_bomb_is_capped_and_killed():
    marker = f"bomb-{uuid.uuid4().hex}"
    program = textwrap.dedent(f"""
        import os, sys, time
        started = 0
        for _ in range(64):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.execv(sys.executable, [sys.executable, "-c",
                                          "import time; time.sleep(30)  # {marker}"])
            started += 1
        print(started)
    """)
    result = run_program(program, timeout=5, processes=8)
    assert result.passed, result
    assert 1 <= int(result.stdout.split()[-1]) <= 8
    assert _alive(marker) == []


def test_pass_at_k_refuses_to_run_without_its_sandbox(monkeypatch):
    monkeypatch.setattr(code_scorer, "sandbox_level", lambda: ("process", "no namespaces here"))
    with pytest.raises(ValueError, match="unsafe_sandbox = true.*|.*no namespaces here"):
        build({"type": "pass_at_k"})
    assert build({"type": "pass_at_k", "unsafe_sandbox": True}).config.unsafe_sandbox


@needs_namespaces
def test_an_interpreter_in_a_hidden_folder_still_runs(tmp_path):
    import subprocess
    import sys

    venv = tmp_path / "venv"  # under /tmp, which the program sees empty but for what it needs
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    result = run_program("import sys, json\nprint(sys.prefix)", python=str(venv / "bin" / "python"))
    assert result.passed, result
    assert result.stdout.strip() == str(venv)
