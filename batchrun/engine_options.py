"""Click options shared by every command that starts an engine (`run`, `serve`)."""

from __future__ import annotations

import click


def size_option(ctx, param, value):
    """Bytes from `2GiB`, `512MiB`, ... (batchrun.cli is imported late: it imports the commands)."""
    if value is None or isinstance(value, int):
        return value
    from batchrun.cli import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


_ENGINE_OPTIONS = [
    click.option("--max-num-seqs", type=click.IntRange(min=1), help="Most sequences per step."),
    click.option("--max-batched-tokens", type=click.IntRange(min=1), help="Token budget per step."),
    click.option("--max-model-len", type=click.IntRange(min=2),
                 help="Context length [default: the model's]."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                 default="auto", show_default=True, help="auto = float32 on CPU, bfloat16 on CUDA."),
    click.option("--kv-cache-dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                 default="auto", show_default=True,
                 help="KV cache element type; auto = the model's dtype. 16-bit halves the memory "
                      "decode attention reads, and changes outputs slightly."),
    click.option("--threads", type=click.IntRange(min=1), help="CPU threads [default: all cores]."),
    click.option("--kv-cache-memory", callback=size_option, metavar="SIZE",
                 help="KV cache size, e.g. 2GiB."),
    click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching."),
]


def engine_options(command):
    """Apply the engine options, in the order --help lists them."""
    for option in reversed(_ENGINE_OPTIONS):
        command = option(command)
    return command
