"""http(s) input through fsspec, from a server on loopback."""

import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

from batchrun.batch.job.runner import run_batch
from batchrun.batch.job.result import RequestCounts
from tests.helpers import job_plan
from tests.fake_engine import fake_model

pytest.importorskip("aiohttp")
SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_root():
    handler = functools.partial(_Quiet, directory=str(SAMPLES))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("name", ["chat.jsonl", "chat.jsonl.gz", "chat.parquet"])
def test_http_input(tmp_path, http_root, name):
    config = job_plan(input=f"{http_root}/{name}", output=str(tmp_path / "out.jsonl"),
                       progress="none", ignore_model_field=True)
    result = run_batch(fake_model(), config)
    assert result.requests == RequestCounts(30, 30, 0)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["custom_id"] == "capital-france"
