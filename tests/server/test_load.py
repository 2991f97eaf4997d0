"""The bounded load test: 64 concurrent streaming clients on loopback, all complete, no errors.
(Figures come from `python benchmarks/loadtest.py`; nothing here asserts a speed.)"""

import asyncio

import pytest

from benchmarks.loadtest import format_summary, run_load
from tests.server.conftest import API_KEY, engine_idle

pytestmark = pytest.mark.slow


def test_64_concurrent_streaming_clients_all_complete(api):
    summary = asyncio.run(run_load(api.url, clients=64, max_tokens=4, api_key=API_KEY,
                                   timeout=300))
    print(format_summary(summary))
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["ok"] == 64 and summary["ttft_s"]["p50"] is not None
    assert engine_idle(api.state.model.engine)
