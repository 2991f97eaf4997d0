"""The trusted runner of one pass_at_k program (run as a script: `python -I -S sandbox_runner.py
CONFIG_JSON`; standard library only). It never runs the program's code: it forks the process
that does, decides pass or fail, kills whatever the program left behind and prints its verdict
as one JSON line on its stdout, which the program cannot reach.

Namespaced (config "namespaced", started by `unshare --user --map-root-user --net --mount
--pid --ipc --uts --fork --kill-child --mount-proc`): the runner is PID 1 of a new PID
namespace, so every process the program starts dies when it exits; before forking it hides
the user's folders (hide()) and makes every mount read-only but the sandbox folder (a bind
mount of itself). The program process
then drops every capability (and can never regain one: securebits NOROOT, an empty bounding
set, no_new_privs) before it execs the launcher.

Not namespaced (the fallback where user namespaces are refused): a child subreaper on Linux,
so a double-forked, setsid descendant is re-parented here and killed; elsewhere only the
program's process group is killed.

The verdict: the runner hands the launcher a random token on a pipe; the program passes only
where its process exits 0 and the launcher wrote back exactly that token on the report pipe
(sandbox_launcher.py says when it does).
"""

import ctypes
import json
import os
import signal
import sys
import time

LINUX = sys.platform.startswith("linux")
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 38, 36
# NOROOT | NOROOT_LOCKED | NO_SETUID_FIXUP | NO_SETUID_FIXUP_LOCKED | KEEP_CAPS_LOCKED
SECUREBITS = 0x2f
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME = 32, 4096, 1024, 2048
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_KEPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

_libc = ctypes.CDLL(None, use_errno=True) if LINUX else None


def _call(name, *args):
    if _libc is None:
        raise OSError(f"{name}: not on Linux")
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _mount(source, target, flags):
    _call("mount", source and source.encode(), target.encode(), None, ctypes.c_ulong(flags),
          None)


def _unescape(path):
    # mountinfo writes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def hide(folders, keep):
    """An empty tmpfs over each of `folders` (the user's home, /tmp...), with the paths of
    `keep` under it (the interpreter, its packages, the sandbox folder) bound back where they
    were. Runs before read_only_but, which makes all of it read-only."""
    folders = [f for f in dict.fromkeys(os.path.realpath(f) for f in folders)
               if os.path.isdir(f) and f != "/"]
    keep = [k for k in dict.fromkeys(os.path.realpath(k) for k in keep) if os.path.isdir(k)]
    # a folder inside another hidden one is hidden with it
    folders = [f for f in folders if not any(f != g and f.startswith(g + "/") for g in folders)]
    held = {}
    for path in keep:
        if any(path == f or path.startswith(f + "/") for f in folders):
            held[path] = os.open(path, os.O_PATH | os.O_DIRECTORY)
    for folder in folders:
        _call("mount", b"tmpfs", folder.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
              b"mode=755")
    # outer paths first, so a kept folder inside another kept one is bound on top of it
    for path, fd in sorted(held.items()):
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC)
        os.close(fd)


def read_only_but(folder):
    """Every mount read-only, `folder` (bound onto itself) writable. Mounts under a mount
    point this process cannot reach are not visible to the program either."""
    _mount(folder, folder, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point, options = _unescape(fields[4]), fields[5].split(",")
        if point == folder or (point + "/").startswith(folder + "/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= _KEPT.get(option, 0)
        try:
            _mount(None, point, flags)
        except OSError:
            if "ro" in options or not os.path.exists(point):
                continue
            raise


def drop_privileges():
    """No capability now or after exec (the process is root of its user namespace)."""
    _call("prctl", PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0)
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def start_program(config, token_fd, report_fd):
    """In the forked child: the program's files on 0-2, no privileges, exec the launcher."""
    try:
        os.setsid()
        os.chdir(config["dir"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        if config["namespaced"]:
            drop_privileges()
        elif LINUX:
            _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd in (token_fd, report_fd):
            os.set_inheritable(fd, True)
        os.closerange(3, min(token_fd, report_fd))
        os.closerange(max(token_fd, report_fd) + 1, 1024)
        argv = [config["python"], "-I", *([] if config["site_packages"] else ["-S"]),
                config["launcher"], str(token_fd), str(report_fd),
                *(str(config[k]) for k in ("memory", "cpu", "file_size", "processes"))]
        os.execve(argv[0], argv, config["env"])
    except BaseException as exc:  # noqa: BLE001 - the child must never return
        try:
            os.write(2, f"sandbox: cannot start the program: {exc}\n".encode())
        finally:
            os._exit(127)


def _children_of(parent):
    """pid -> ppid of every process, for the subreaper's sweep (Linux /proc)."""
    tree = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                tree[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                pass
    found, frontier = set(), {parent}
    while frontier:
        frontier = {pid for pid, ppid in tree.items() if ppid in frontier} - found
        found |= frontier
    return found


def kill_all(config, program_pid):
    if config["namespaced"]:
        try:
            os.kill(-1, signal.SIGKILL)  # PID 1: every other process of the namespace
        except ProcessLookupError:
            pass
    else:
        try:
            os.killpg(program_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if LINUX:
            for _ in range(100):
                left = _children_of(os.getpid())
                if not left:
                    break
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                _reap()
    _reap(block=True)


def _reap(block=False):
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_for(pid, timeout):
    """The program's wait status (None at the timeout), reaping orphans meanwhile."""
    deadline, pause = time.monotonic() + timeout, 0.0005
    while True:
        try:
            done, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if done == pid:
            return status
        if done:
            continue
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def main():
    config = json.loads(sys.argv[1])
    verdict = {"passed": False, "returncode": None, "timed_out": False, "error": None}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if LINUX:
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not trace or read us
    try:
        if config.get("cgroup"):  # first: /sys is read-only after read_only_but
            with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        if config["namespaced"]:
            _mount(None, "/", MS_REC | MS_PRIVATE)
            hide(config["hide"], [*config["keep"], config["dir"]])
            read_only_but(config["dir"])
        elif LINUX:
            _call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError as exc:
        verdict["error"] = f"the sandbox cannot be set up: {exc}"
        print(json.dumps(verdict), flush=True)
        return 3
    token = os.urandom(16)
    token_r, token_w = os.pipe()
    report_r, report_w = os.pipe()
    os.write(token_w, token)
    os.close(token_w)
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        start_program(config, token_r, report_w)
    os.close(token_r)
    os.close(report_w)
    status = wait_for(pid, config["timeout"])
    kill_all(config, pid)
    if status is None:
        verdict["timed_out"] = True
    else:
        verdict["returncode"] = os.waitstatus_to_exitcode(status)
    os.set_blocking(report_r, False)
    try:
        report = os.read(report_r, 64)
    except BlockingIOError:
        report = b""
    verdict["passed"] = status is not None and verdict["returncode"] == 0 and report == token
    print(json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
