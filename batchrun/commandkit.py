"""What the commands (run, sweep, serve) share: their exit codes, the usage error, the model
loader (on Ray when asked) with the errors a user can fix reported as usage errors, and the
SIGINT/SIGTERM handling of a run that can be resumed."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any, Callable

import click

if TYPE_CHECKING:
    from batchrun.options.ray import RayOptions

EXIT_OK, EXIT_CRASH, EXIT_USAGE, EXIT_TOO_MANY_FAILED, EXIT_EXPIRED, EXIT_INTERRUPTED = \
    0, 1, 2, 3, 4, 75
INTERRUPTED = "interrupted; what finished is committed: rerun with --resume"

# (model name or path, EngineConfig) -> a loaded model (batchrun.served_model.ServedModel)
Loader = Callable[[str | None, Any], Any]


class UsageError(click.ClickException):
    exit_code = EXIT_USAGE


def load_model(model: str | None, engine_config: Any) -> Any:
    """batchrun.llm.load; UsageError for an unknown model or a bad engine option."""
    from batchrun import llm
    from batchrun.models.weights.loader import ModelNotFoundError
    from batchrun.models.lora.adapter import LoraError

    try:
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
    """SIGINT/SIGTERM: the first stops admitting and lets in-flight requests finish within the
    grace period, the second drops them, the third raises KeyboardInterrupt. `stop` is a
    batch.job.loop.StopRequest; `log` the command's logger."""

    def __init__(self, stop: Any, log: logging.Logger):
        self.stop, self.log = stop, log
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stop.immediate:
            raise KeyboardInterrupt
        self.stop.set()
        if self.stop.immediate:
            self.log.warning("%s again: dropping the requests in flight", name)
        else:
            self.log.warning("%s: stopping (send it again to stop at once)", name)

    def __enter__(self) -> "Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def interrupted(log: logging.Logger) -> int:
    """After a third signal (KeyboardInterrupt): say so; the exit code."""
    log.warning(INTERRUPTED)
    return EXIT_INTERRUPTED
