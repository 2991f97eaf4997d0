"""Servers started by the tests: uvicorn in a thread on a free loopback port."""

import contextlib
import io
import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

API_KEY = "sk-batchrun-test"
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Hi"}]}}


@dataclass
class Running:
    url: str
    state: object
    server: object  # the uvicorn.Server

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key=API_KEY, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key=API_KEY, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)


@contextlib.contextmanager
def serve(model, data_dir, **config):
    """Run the app over `model` until the block ends; the engine is left empty."""
    from batchrun.openai.serving import ServingOptions
    from batchrun.options.fields import public_fields
    from batchrun.options.openai import OpenAIOptions
    from batchrun.options.server import ServerOptions
    from batchrun.server.listener import serve_in_thread
    from batchrun.server.state import ServerState

    config.setdefault("api_key", API_KEY)
    openai = {f.name for f in public_fields(OpenAIOptions)}
    serving = ServingOptions.of(OpenAIOptions(**{k: config.pop(k) for k in list(config)
                                                 if k in openai}))
    state = ServerState(model, ServerOptions(data_dir=data_dir, **config), serving)
    with serve_in_thread(state) as (url, server):
        yield Running(url, state, server)


@pytest.fixture(scope="module")
def api(real_model, tmp_path_factory):
    """The bundled model behind the API with an API key. Module-scoped: while it runs, its
    thread owns real_model's engine, which other modules use directly."""
    with serve(real_model, tmp_path_factory.mktemp("server")) as running:
        yield running


def wait_for(predicate, timeout=30.0, interval=0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def engine_idle(engine) -> bool:
    return (not engine.has_unfinished_requests()
            and engine.kv.num_free_blocks == engine.kv.num_blocks)


@pytest.fixture
def manager(tmp_path):
    """The Batches API's manager on a file store, with no engine."""
    from batchrun.server.batches import BatchManager
    from batchrun.server.files import FileStore
    from batchrun.server.metrics import ServerMetrics

    files = FileStore(tmp_path / "files")
    state = SimpleNamespace(files=files, served_name="m", engine=None, metrics=ServerMetrics(),
                            config=SimpleNamespace(max_concurrent_batches=1))
    return BatchManager(state, tmp_path / "batches")


def upload_line(manager) -> dict:
    """A batch input file of one chat line, uploaded to the manager's file store."""
    return manager.state.files.upload(io.BytesIO(json.dumps(LINE).encode() + b"\n"),
                                      "in.jsonl", "batch")
