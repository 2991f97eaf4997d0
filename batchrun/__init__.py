"""batchrun: offline LLM batch runner with its own continuous-batching engine."""

__version__ = "0.1.0"
