"""What several test modules share: the CLI as a subprocess (on the fake engine or the real
one), `batchrun serve` as a subprocess, tiny engines, and job plans from keywords."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository root first, so `-m tests.fake_batchrun` and `-m batchrun` import this checkout.
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def batchrun(*args, real=False, input=None, env=None, timeout=120, text=False):
    """`batchrun ARGS...` as a subprocess from the repository root: on the fake engine
    (`python -m tests.fake_batchrun`), or with real=True the CLI itself (`python -m batchrun`,
    the bundled model). Output is bytes unless text=True."""
    module = "batchrun" if real else "tests.fake_batchrun"
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                          env={**ENV, **(env or {})}, input=input, capture_output=True,
                          text=text, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen
    output: str = ""  # what the server printed, once the block has ended


@contextlib.contextmanager
def serve_cli(*args, env=None, stop=signal.SIGTERM, start_timeout=180):
    """`python -m batchrun serve --port <free> ARGS...` until the block ends, once /health
    answers 200; then it gets `stop` and is waited for (its output and returncode kept).
    `env` adds variables to the environment; a value None removes one."""
    port = free_port()
    env = {k: v for k, v in {**ENV, **(env or {})}.items() if v is not None}
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "serve", "--port", str(port),
                             *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = ServeProcess(f"http://127.0.0.1:{port}", proc)
    try:
        _wait_healthy(running, start_timeout)
        yield running
    finally:
        proc.send_signal(stop)
        running.output, _ = proc.communicate(timeout=60)


def _wait_healthy(running: ServeProcess, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while True:
        assert running.proc.poll() is None, running.proc.stdout.read()
        try:
            if httpx.get(running.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not come up"
        time.sleep(0.3)


def tiny_engine(arch, tmp_path, **overrides):
    """A tiny random checkpoint of `arch` (tests/tiny_models.py: ARCHS, else BACKEND_ARCHS) in
    tmp_path: (the transformers model, a batchrun engine on the native path over the same weights
    on the CPU); `overrides` set EngineConfig
    fields (block_size 4 unless given)."""
    import torch
    from transformers import AutoConfig

    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch import native
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import ARCHS, BACKEND_ARCHS, IdTokenizer, make_tiny

    hf = make_tiny(arch, tmp_path, archs=ARCHS if arch in ARCHS else BACKEND_ARCHS)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    module = native.module_for(hf_config)
    model = build_model(module.Model, module.ModelConfig.from_hf(hf_config), tmp_path,
                        torch.device("cpu"), torch.float32)
    overrides.setdefault("block_size", 4)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(**overrides), [2],
                          torch.device("cpu"), torch.float32)
    return hf, engine


def job_plan(**options):
    """The JobPlan of a run, from keywords: `input=` (a path or a list), `output=`, any option
    by its public name (resume=True, max_in_flight=8, tool_parser="hermes", ...), and
    `defaults=RequestDefaults(...)`, `hold_lease=True` (the plan holds the output's lease, as
    the CLI's does). Raises BatchConfigError as the run would."""
    from batchrun.batch.job.plan import make_plan
    from batchrun.options.engine import EngineConfig
    from batchrun.options.fields import public_fields, validate
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.openai import OpenAIOptions, RequestDefaults
    from batchrun.options.run import RunOptions

    defaults = options.pop("defaults", None) or RequestDefaults()
    hold_lease = options.pop("hold_lease", False)
    if isinstance(options.get("input"), str):
        options["input"] = [options["input"]]
    sections = {}
    for model in (InputOptions, JobOptions, OpenAIOptions, EngineConfig):
        names = {f.name for f in public_fields(model)}
        sections[model] = validate(model, {k: options.pop(k) for k in list(options) if k in names})
    if options:
        raise TypeError(f"not options: {', '.join(options)}")
    return make_plan(RunOptions(inputs=sections[InputOptions], job=sections[JobOptions],
                                engine=sections[EngineConfig], openai=sections[OpenAIOptions],
                                defaults=defaults), hold_lease=hold_lease)


TERMINAL_BATCH = ("completed", "failed", "cancelled", "expired")


def jsonl(lines) -> bytes:
    import json

    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def upload_batch_file(client, lines, name="input.jsonl"):
    """Batch lines uploaded through the openai client's Files API (purpose batch)."""
    import io

    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch")


def poll_batch(client, batch_id, until=TERMINAL_BATCH, timeout=120):
    """The batch once its status is one of `until`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def file_records(client, file_id) -> list[dict]:
    """The JSON lines of a stored file."""
    import json

    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def held_bytes(model) -> int:
    """Every distinct tensor the model holds: parameters, and the tensors quantized and packed
    layers keep as attributes."""
    import torch

    seen, total = set(), 0
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [v for k, v in vars(module).items() if isinstance(v, torch.Tensor)
                    and not k.startswith("_")]
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


# The shapes (query heads per KV head, head_dim) the kernel tests specialise the attention
# kernel for: a build for all sixteen takes minutes on a 2-core machine, one per vector path.
KERNEL_TEST_SHAPES = ((1, 64), (1, 128), (3, 64), (4, 64), (4, 128))


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` for this CPU."""
    from batchrun.models.quant.cpu import cpu_flags

    return flag in cpu_flags()


def kernel_library(variant: str = "native", *flags: str):
    """The CPU kernels the unit tests load: `variant`'s vector path (kernels.VARIANTS) with the
    attention kernel specialised for KERNEL_TEST_SHAPES only (others take its generic loop)."""
    from batchrun.engine import kernels

    return kernels.library(kernels.VARIANTS[variant] + kernels.shapes_flags(KERNEL_TEST_SHAPES)
                           + flags)


def matrix(values, keep, key=lambda v: v) -> list:
    """`values` as pytest parameters: those whose key is in `keep` (one representative per
    mechanism) run by default, the rest carry the `matrix` mark and run with `pytest --matrix`
    (the whole architecture matrix, outside the default suite's time)."""
    import pytest

    unknown = set(keep) - {key(v) for v in values}
    assert not unknown, f"representatives not in the matrix: {sorted(unknown)}"
    return [v if key(v) in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)),
                                                  marks=pytest.mark.matrix)
            for v in values]
