"""`batchrun serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from batchrun.engine_options import engine_options, size_option


def default_data_dir() -> Path:
    root = os.environ.get("BATCHRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "batchrun")
    return Path(root) / "server"


def api_key_option(ctx, param, value):
    """The key, refusing one that cannot work. Click reads an empty variable as unset, which
    would quietly serve without authentication, so an empty BATCHRUN_API_KEY is looked for here."""
    from batchrun.server.state import check_api_key

    if value is None and os.environ.get(param.envvar) == "":
        value = ""
    try:
        check_api_key(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


@click.command("serve")
@click.option("--model", help="Registry name, HF folder, .gguf file or hub id "
                              "[default: the bundled smollm2-135m].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="BATCHRUN_API_KEY", show_envvar=True, callback=api_key_option,
              help="Require 'Authorization: Bearer KEY' on every route but /health, /metrics "
                   "and /version.")
@click.option("--served-model-name", help="The model name the API shows and accepts "
                                          "[default: the model's registry name].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where uploaded files, batch state and batch results live "
                   "[default: $BATCHRUN_CACHE/server].")
@engine_options
@click.option("--max-queued-requests", type=click.IntRange(min=1), default=1024,
              show_default=True, help="Interactive requests in flight before the API answers 429.")
@click.option("--max-body-size", callback=size_option, metavar="SIZE", default="16MiB",
              show_default=True, help="Largest JSON request body.")
@click.option("--max-upload-size", callback=size_option, metavar="SIZE", default="200MiB",
              show_default=True, help="Largest file upload.")
@click.option("--read-timeout", type=click.FloatRange(min=0, min_open=True), default=15.0,
              show_default=True, metavar="SECONDS", help="Close a connection that takes longer "
              "than this to send a request's header, or pauses this long inside its body.")
@click.option("--timeout-keep-alive", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS",
              help="Close a kept-alive connection idle this long between requests.")
@click.option("--max-connections", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Open connections (idle ones included) past which requests get 503.")
@click.option("--max-concurrent-batches", type=click.IntRange(min=1), default=1,
              show_default=True, help="Batches-API jobs running at once (the rest queue).")
@click.option("--temperature", type=click.FloatRange(0, 2),
              help="Temperature for requests that leave it out.")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="max_tokens for requests that leave it out [default: fill the context].")
@click.option("--ignore-model-field", is_flag=True,
              help="Serve every request whatever its `model` field says.")
@click.option("--chat-template", metavar="FILE", help="A Jinja chat template overriding the "
              "model's (e.g. batchrun/openai/templates/chatml_tools.jinja, which renders tools).")
@click.option("--tool-parser", help="How tool calls are read from the output (hermes, "
              "llama3_json, mistral) [default: from the chat template's markers].")
@click.option("--reasoning-parser", help="Move <think>...</think> into reasoning_content "
              "[default: leave it in content].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def serve(model, host, port, api_key, served_model_name, data_dir, max_num_seqs,
          max_batched_tokens, max_model_len, dtype, kv_cache_dtype, threads, kv_cache_memory,
          no_prefix_cache,
          max_queued_requests, max_body_size, max_upload_size, read_timeout,
          timeout_keep_alive, max_connections, max_concurrent_batches,
          temperature, max_tokens, ignore_model_field, chat_template, tool_parser,
          reasoning_parser, log_level):
    """Serve chat completions (JSON and SSE), models, files and batches over HTTP."""
    import uvicorn

    from batchrun.cli import _load_model
    from batchrun.config import EngineConfig
    from batchrun.openai.params import RequestDefaults
    from batchrun.server.app import create_app
    from batchrun.server.listener import uvicorn_options
    from batchrun.server.state import ServerConfig, ServerState

    overrides = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                 "enable_prefix_caching": not no_prefix_cache,
                 "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched_tokens,
                 "max_model_len": max_model_len, "threads": threads,
                 "kv_cache_memory": kv_cache_memory}
    engine_config = EngineConfig.default(**{k: v for k, v in overrides.items() if v is not None})
    logging.getLogger().setLevel(log_level.upper())
    template = _check_openai_options(chat_template, tool_parser, reasoning_parser)
    loaded = _load_model(model, engine_config)
    config = ServerConfig(
        data_dir=data_dir or default_data_dir(), api_key=api_key,
        served_model_name=served_model_name, max_body_bytes=max_body_size,
        max_upload_bytes=max_upload_size, max_queued_requests=max_queued_requests,
        read_timeout=read_timeout, timeout_keep_alive=timeout_keep_alive,
        max_connections=max_connections, max_concurrent_batches=max_concurrent_batches,
        ignore_model_field=ignore_model_field,
        defaults=RequestDefaults(temperature=temperature, max_tokens=max_tokens),
        chat_template=template, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    state = ServerState(loaded, config)
    click.echo(f"serving {state.served_name} on http://{host}:{port} (data in {config.data_dir}"
               f"{', API key required' if config.api_key else ''})", err=True)
    uvicorn.run(create_app(state), host=host, port=port, log_level=log_level,
                **uvicorn_options(config))


def _check_openai_options(chat_template, tool_parser, reasoning_parser) -> str | None:
    """The template text; a usage error (exit 2) for a missing file or an unknown parser."""
    from batchrun.cli import ConfigError
    from batchrun.openai.parsers import reasoning_parser as find_reasoning
    from batchrun.openai.parsers import tool_parser as find_tool
    from batchrun.openai.render import load_chat_template

    try:
        if tool_parser:
            find_tool(tool_parser)
        if reasoning_parser:
            find_reasoning(reasoning_parser)
        return load_chat_template(chat_template) if chat_template else None
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
