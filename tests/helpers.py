"""What several test modules share: the CLI as a subprocess on the fake engine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_ENGINE_ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def batchrun(*args, input=None, env=None, timeout=120):
    """`python -m batchrun ARGS...` from the repository root, on the fake engine."""
    return subprocess.run([sys.executable, "-m", "tests.fake_batchrun", *map(str, args)], cwd=ROOT,
                          env={**FAKE_ENGINE_ENV, **(env or {})}, input=input,
                          capture_output=True, timeout=timeout)


def job_plan(**options):
    """The JobPlan of a run, from keywords: `input=` (a path or a list), `output=`, any option
    by its public name (resume=True, max_in_flight=8, tool_parser="hermes", ...), and
    `defaults=RequestDefaults(...)`. Raises BatchConfigError as the run would."""
    from batchrun.batch.plan import make_plan
    from batchrun.options.engine import EngineConfig
    from batchrun.options.fields import public_fields, validate
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.openai import OpenAIOptions, RequestDefaults
    from batchrun.options.run import RunOptions

    defaults = options.pop("defaults", None) or RequestDefaults()
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
                                defaults=defaults))
