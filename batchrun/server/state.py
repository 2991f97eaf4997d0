"""What a running server holds: its options, the model, the shared engine and the stores."""

from __future__ import annotations

import dataclasses
import time

from batchrun.engine.async_engine import AsyncEngine
from batchrun.llm import LoadedModel
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.server import ServerOptions
from batchrun.server.metrics import ServerMetrics


class ServerState:
    def __init__(self, model: LoadedModel, config: ServerOptions,
                 serving: ServingOptions | None = None):
        """`config.data_dir` must be set (the CLI fills in its default)."""
        from batchrun.server.batches import BatchManager
        from batchrun.server.files import FileStore

        self.config = config
        self.model = model
        self.served_name = config.served_model_name or model.name
        self.created = int(time.time())
        # Every name a request's `model` field may use for this model.
        self.model_aliases = tuple(dict.fromkeys(
            n for n in (model.name, *model.aliases) if n != self.served_name))
        # The model as the API names it: responses say served_name, requests may use any alias.
        self.served_model = dataclasses.replace(model, name=self.served_name,
                                                aliases=self.model_aliases)
        # LoRA adapter name -> its path (--lora); requests may name them as their `model`.
        self.lora_paths: dict[str, str] = dict(model.engine_config.lora.adapters)
        self.serving_options = serving or ServingOptions()
        self.serving = OpenAIServing(self.served_model, self.serving_options)
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(model.engine, max_queued=config.max_queued_requests,
                                  on_finished=self.metrics.record_finished)
        self.metrics.attach_engine(self.engine)
        data_dir = config.data_dir
        assert data_dir is not None, "ServerState needs config.data_dir"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.files = FileStore(data_dir / "files")
        self.batches = BatchManager(self, data_dir / "batches")

    def start(self) -> None:
        self.engine.start()
        self.files.start()
        self.batches.start()

    def stop(self) -> None:
        self.batches.stop()
        self.files.stop()
        self.engine.shutdown()
