"""What the commands (run, sweep, serve) share: their exit codes, the usage error, the model
loader (on Ray when asked) with the errors a user can fix reported as usage errors, and the
SIGINT/SIGTERM handling of a run that can be resumed (bounded: it always ends the process)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable

import click

if TYPE_CHECKING:
    from batchrun.options.ray import RayOptions

EXIT_OK, EXIT_CRASH, EXIT_USAGE, EXIT_TOO_MANY_FAILED, EXIT_EXPIRED, EXIT_INTERRUPTED = \
    0, 1, 2, 3, 4, 75
INTERRUPTED = "interrupted; what finished is committed: rerun with --resume"
# After a first signal, seconds beyond the grace period the run gets to wind down (abort, commit)
# before it is stopped at once; after a second, seconds before the process exits regardless.
WIND_DOWN_S = 30.0
LAST_RESORT_S = 10.0

# (model name or path, EngineConfig) -> a loaded model (batchrun.served_model.ServedModel)
Loader = Callable[[str | None, Any], Any]


class UsageError(click.ClickException):
    exit_code = EXIT_USAGE


def load_model(model: str | None, engine_config: Any) -> Any:
    """batchrun.llm.load, after memory_fit.check_model_fits (the config's sizes, the folder's
    code, the memory it needs: refused before anything is allocated); UsageError for an unknown
    model, a model folder batchrun refuses, one that does not fit, or a bad engine option."""
    from batchrun import llm, memory_fit
    from batchrun.models.weights.loader import ModelNotFoundError
    from batchrun.models.lora.adapter import LoraError

    if engine_config is None:  # llm.load's default, which the memory check reads too
        from batchrun.options.engine import EngineConfig

        engine_config = EngineConfig.default()
    try:
        memory_fit.check_model_fits(model, engine_config)
        return llm.load(model, engine_config)
    except (ModelNotFoundError, LoraError) as exc:  # a LoraError names the adapter and its path
        raise UsageError(str(exc)) from exc
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"cannot load model {model or '(default)'}: {exc}") from exc


def model_loader(ctx: click.Context | None) -> Loader:
    """The loader commands use: load_model, unless the caller of the CLI injected another as
    `obj={"load_model": ...}` (the test suite's fake engine)."""
    obj = ctx.find_root().obj if ctx is not None else None
    if isinstance(obj, dict) and obj.get("load_model") is not None:
        return obj["load_model"]
    return load_model


def on_ray(options: RayOptions, load: Loader) -> Loader:
    """`load` as it is, or with --ray a loader that starts the engine replicas on Ray (each
    loading the model with `load`) and keeps only the tokenizer here."""
    if not options.ray:
        return load
    from batchrun.distributed.client import ray_loader

    return ray_loader(options, load)


class Signals:
    """SIGINT/SIGTERM of a resumable run: the first stops admitting and lets in-flight requests
    finish within the grace period; the second ends the run at once (KeyboardInterrupt: the job
    loop commits what finished on its way out). Whatever the main thread is doing (a render, a
    fetch, a long step), the process ends within a bounded time: `grace + WIND_DOWN_S` seconds
    after the first signal a watchdog thread delivers the second itself, and LAST_RESORT_S
    after a second signal that did not end the run (the main thread stuck in native code) the
    process exits 75 without waiting. `stop` is a batch.job.loop.StopRequest; `log` the
    command's logger."""

    def __init__(self, stop: Any, log: logging.Logger, grace: float = 10.0):
        self.stop, self.log, self.grace = stop, log, grace
        self._old: dict[int, Any] = {}
        self._timers: list[threading.Timer] = []
        self._forced = False  # the watchdog sent the signal now being handled

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.stop.is_set():
            self.stop.set()
            self.log.warning("%s: stopping (send it again to stop at once)", name)
            self._arm(self.grace + WIND_DOWN_S, self._force)
            return
        self.stop.set()  # immediate: a loop that looks drops what is in flight
        if not self._forced:
            self.log.warning("%s again: stopping at once; what finished is committed", name)
        self._arm(LAST_RESORT_S, self._exit_now)
        raise KeyboardInterrupt

    def _arm(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _force(self) -> None:
        self.log.warning("still running %.0f s after the signal: stopping at once; what "
                         "finished is committed", self.grace + WIND_DOWN_S)
        self._forced = True
        main = threading.main_thread().ident
        if main is not None:  # always, once the interpreter runs
            signal.pthread_kill(main, signal.SIGINT)

    def _exit_now(self) -> None:
        self.log.error("the run did not stop %.0f s after it was told to stop at once: "
                       "exiting; %s", LAST_RESORT_S, INTERRUPTED)
        os._exit(EXIT_INTERRUPTED)

    def __enter__(self) -> "Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for timer in self._timers:
            timer.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)


def interrupted(log: logging.Logger) -> int:
    """After a third signal (KeyboardInterrupt): say so; the exit code."""
    log.warning(INTERRUPTED)
    return EXIT_INTERRUPTED
