"""What a running server holds: its options, the model, the shared engine and the stores."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.engine.async_engine import AsyncEngine
from batchrun.openai.params import RequestDefaults
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.server.metrics import ServerMetrics


def check_api_key(key: str | None) -> None:
    """A ValueError for a key that cannot work: empty would switch authentication off, and
    surrounding whitespace can never match (the presented token is stripped)."""
    if key is None:
        return
    if not key.strip():
        raise ValueError("the API key is empty, which would turn authentication off; leave it "
                         "unset to serve without a key")
    if key != key.strip():
        raise ValueError("the API key has leading or trailing whitespace, which no client's "
                         "token can match")


@dataclass
class ServerConfig:
    data_dir: Path
    api_key: str | None = None  # None = no authentication
    served_model_name: str | None = None  # None = the model's registry name
    max_body_bytes: int = 16 << 20
    max_upload_bytes: int = 200 << 20  # OpenAI's limit for a batch input file
    # Interactive requests in the engine at once; past it the API answers 429.
    max_queued_requests: int = 1024
    max_concurrent_batches: int = 1
    # The HTTP listener (batchrun.server.listener): seconds to send a request's header and the
    # longest pause in its body; seconds an idle kept-alive connection stays; open connections
    # past which requests get 503 (None = no limit).
    read_timeout: float = 15.0
    timeout_keep_alive: float = 5.0
    max_connections: int | None = 2048
    # Requests one batch keeps in the engine; None = what batch_job.batch_in_flight leaves free.
    batch_max_in_flight: int | None = None
    ignore_model_field: bool = False
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    chat_template: str | None = None  # template text overriding the model's
    tool_parser: str | None = None  # None = the format the chat template teaches, if any
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_api_key(self.api_key)

    def serving_options(self) -> ServingOptions:
        return ServingOptions(defaults=self.defaults, ignore_model_field=self.ignore_model_field,
                              chat_template=self.chat_template, tool_parser=self.tool_parser,
                              reasoning_parser=self.reasoning_parser)


class ServerState:
    def __init__(self, model: Any, config: ServerConfig):
        from batchrun.server.batches import BatchManager
        from batchrun.server.files import FileStore

        self.config = config
        self.model = model  # batchrun.llm.LoadedModel
        self.served_name = config.served_model_name or model.name
        self.created = int(time.time())
        # Every name a request's `model` field may use for this model.
        self.model_aliases = tuple(dict.fromkeys(
            n for n in (model.name, *model.aliases) if n != self.served_name))
        # The model as the API names it: responses say served_name, requests may use any alias.
        self.served_model = dataclasses.replace(model, name=self.served_name,
                                                aliases=self.model_aliases)
        self.serving = OpenAIServing(self.served_model, config.serving_options())
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(model.engine, max_queued=config.max_queued_requests,
                                  on_finished=self.metrics.record_finished)
        self.metrics.attach_engine(self.engine)
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.files = FileStore(config.data_dir / "files")
        self.batches = BatchManager(self, config.data_dir / "batches")

    def start(self) -> None:
        self.engine.start()
        self.batches.start()

    def stop(self) -> None:
        self.batches.stop()
        self.engine.shutdown()
