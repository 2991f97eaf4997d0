"""The transformers backend: any decoder-only model transformers can build, run with its own
modelling code on the engine's paged KV cache and scheduling (model.py), its attention through
the function attention.py registers. support.py decides, from the config alone, which path runs
a model."""
