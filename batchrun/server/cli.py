"""`batchrun serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from batchrun.options.click_options import click_options
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError
from batchrun.options.help_sections import SectionedCommand
from batchrun.options.job import InputOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.run import from_cli
from batchrun.options.server import ServerOptions
from batchrun.commandkit import UsageError, model_loader


def default_data_dir() -> Path:
    root = os.environ.get("BATCHRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "batchrun")
    return Path(root) / "server"


def _api_key_from_env(kwargs: dict) -> None:
    """Click reads an empty variable as unset, which would quietly serve without
    authentication: an empty BATCHRUN_API_KEY is passed on, for the schema to refuse."""
    if kwargs.get("api_key") is None and os.environ.get("BATCHRUN_API_KEY") == "":
        kwargs["api_key"] = ""


@click.command("serve", cls=SectionedCommand, first=("server",),
               short_help="Serve the model over an OpenAI-compatible HTTP API (Batches too).")
@click_options(InputOptions, only=("model",))
@click_options(ServerOptions, EngineConfig, OpenAIOptions, RequestDefaults)
@click.pass_context
def serve(ctx, model, **kwargs):
    """Serve chat completions (JSON and SSE), models, files and batches over HTTP."""
    import uvicorn

    from batchrun.batch.storage import io
    from batchrun.openai.serving import ServingOptions
    from batchrun.server.app import create_app
    from batchrun.server.listener import bind_listener, uvicorn_options
    from batchrun.server.state import ServerState

    _api_key_from_env(kwargs)
    try:
        server = from_cli(ServerOptions, kwargs)
        engine_config = from_cli(EngineConfig, kwargs)
        # Image parts' s3:// / gs:// URLs: fsspec with the environment's credentials.
        serving = ServingOptions.of(from_cli(OpenAIOptions, kwargs),
                                    from_cli(RequestDefaults, kwargs), open_url=io.open_read)
    except (OptionsError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if server.data_dir is None:
        server = server.model_copy(update={"data_dir": default_data_dir()})
    logging.getLogger().setLevel(server.log_level.upper())
    try:
        sock = bind_listener(server.host, server.port)
    except OSError as exc:
        raise UsageError(str(exc)) from None
    with sock:
        loaded = model_loader(ctx)(model, engine_config)
        try:
            state = ServerState(loaded, server, serving)
        except ValueError as exc:  # an option the loaded model cannot take (--score-tokens)
            raise UsageError(str(exc)) from None
        click.echo(f"serving {state.served_name} on http://{server.host}:{server.port} (data in "
                   f"{server.data_dir}{', API key required' if server.api_key else ''})",
                   err=True)
        config = uvicorn.Config(create_app(state), host=server.host, port=server.port,
                                log_level=server.log_level, **uvicorn_options(server))
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on (as uvicorn.run)
            pass
