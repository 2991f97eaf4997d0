"""Command line: `batchrun run INPUT -o OUTPUT`, `batchrun models ...`.

Exit codes: 0 the run completed (however many lines failed; they are in the error file),
2 usage or configuration error, 1 crash. torch and transformers are imported inside commands
so `batchrun --help` stays fast.
"""

from __future__ import annotations

import logging
import re
import sys

import click

from batchrun import __version__

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `2GiB`, `512MiB`, `1.5GB`, `4g`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class ByteSize(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, message="%(prog)s %(version)s")
def main() -> None:
    """Run OpenAI Batch files through a local continuous-batching LLM engine."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("-o", "--output", required=True, help="Output JSONL (local path or fsspec URL).")
@click.option("--errors", help="Error file [default: <output stem>.errors.jsonl].")
@click.option("--metrics", help="Metrics JSON [default: <output stem>.metrics.json].")
@click.option("--model", help="Registry name, HF folder, .gguf file or hub id "
                              "[default: the bundled smollm2-135m].")
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="Most sequences per step.")
@click.option("--max-batched-tokens", type=click.IntRange(min=1), help="Token budget per step.")
@click.option("--max-model-len", type=click.IntRange(min=2),
              help="Context length [default: the model's].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True, help="auto = float32 on CPU, bfloat16 on CUDA.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads [default: all cores].")
@click.option("--kv-cache-memory", type=ByteSize(), help="KV cache size, e.g. 2GiB.")
@click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching.")
@click.option("--max-in-flight", type=click.IntRange(min=1),
              help="Requests handed to the engine at once [default: 4 x max-num-seqs].")
@click.option("--temperature", type=click.FloatRange(0, 2),
              help="Temperature for requests that leave it out.")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="max_tokens for requests that leave it out [default: fill the context].")
@click.option("--ignore-model-field", is_flag=True,
              help="Run every request on the loaded model whatever its `model` field says.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
def run(input_path, output, errors, metrics, model, max_num_seqs, max_batched_tokens,
        max_model_len, dtype, threads, kv_cache_memory, no_prefix_cache, max_in_flight,
        temperature, max_tokens, ignore_model_field, quiet):
    """Run the batch file INPUT (JSONL or JSONL.gz) and write results in input order."""
    from batchrun.batch import io
    from batchrun.config import EngineConfig

    if not io.exists(input_path):
        raise click.BadParameter(f"{input_path} does not exist", param_hint="INPUT")
    overrides = {"dtype": dtype, "enable_prefix_caching": not no_prefix_cache,
                 "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched_tokens,
                 "max_model_len": max_model_len, "threads": threads,
                 "kv_cache_memory": kv_cache_memory}
    engine_config = EngineConfig.default(**{k: v for k, v in overrides.items() if v is not None})
    if quiet:
        logging.getLogger().setLevel(logging.WARNING)

    loaded = _load_model(model, engine_config)

    from batchrun.batch.metrics import summary_text
    from batchrun.batch.runner import RunConfig, run_batch
    from batchrun.openai.params import RequestDefaults

    config = RunConfig(
        input=input_path, output=output, errors=errors, metrics=metrics,
        defaults=RequestDefaults(temperature=temperature, max_tokens=max_tokens),
        ignore_model_field=ignore_model_field,
        max_in_flight=max_in_flight or 4 * engine_config.scheduler.max_num_seqs,
        progress=not quiet)
    result = run_batch(loaded, config)
    if not quiet:
        click.echo(summary_text(result), err=True)
        click.echo(f"output: {config.output}; errors: {config.errors_path}; "
                   f"metrics: {config.metrics_path}", err=True)


class ConfigError(click.ClickException):
    exit_code = 2


def _load_model(model, engine_config):
    """llm.load, with the errors a user can fix (unknown model, bad option) as exit code 2."""
    from batchrun import llm
    from batchrun.models.loader import ModelNotFoundError

    try:
        return llm.load(model, engine_config)
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"cannot load model {model or '(default)'}: {exc}") from exc


def _add_models_group() -> None:
    try:
        from batchrun.models.cli import models
    except ModuleNotFoundError as exc:  # the registry's commands land separately
        if exc.name not in ("batchrun.models", "batchrun.models.cli"):
            raise
        return
    main.add_command(models)


_add_models_group()
