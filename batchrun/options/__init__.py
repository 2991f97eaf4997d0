"""Every option of batchrun, declared once as a typed pydantic field (type, range, default,
description). The click options of `run`, `serve`, `plan` and `validate` are generated from
these models (options.click_options), job specs (TOML) are validated by them (batch/jobspec.py),
and --help is their descriptions. Adding an option means adding a field here and the code that
uses it.

    engine.py   EngineConfig (cache, scheduler, device): what the engine is built with
    openai.py   OpenAIOptions (template, parsers, model-field check, embedding pooling),
                RequestDefaults
    job.py      InputOptions (what is read), JobOptions (where results go, resume, reporting)
    server.py   ServerOptions (listener, limits, authentication, data dir)
    run.py      RunOptions: one run's options by concern, from the CLI or a job spec
"""
