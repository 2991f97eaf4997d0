"""The per-replica counters a Ray run's metrics report: read at the run's end, they count every
request (they were refreshed at most once a second, so the last requests were often missing:
28 of 36). The client over in-process replicas, ray's get/wait answering directly."""

import pytest

ray = pytest.importorskip("ray")

from batchrun.distributed.client import RayEngineClient  # noqa: E402
from batchrun.distributed.routing import PrefixRouter  # noqa: E402
from batchrun.engine.client import EngineStats  # noqa: E402
from batchrun.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402


class Ref:
    def __init__(self, value):
        self.value = value


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Ref(self.fn(*args))


class Replica:
    """An engine replica that finishes what it was sent at its next collect."""

    def __init__(self):
        self.queued, self.finished = [], 0
        self.add = Method(self.queued.extend)
        self.collect = Method(self._collect)
        self.stats = Method(lambda: EngineStats(requests_finished=self.finished))

    def _collect(self, timeout):
        done, self.queued[:] = list(self.queued), []
        self.finished += len(done)
        return [RequestOutput(rid, prompt, [CompletionOutput(0, "x", [1], "length")], True)
                for rid, prompt, *_ in done]


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: (
        [r.value for r in refs] if isinstance(refs, list) else refs.value))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (
        list(refs), []))
    c = RayEngineClient.__new__(RayEngineClient)
    c.replicas = [Replica(), Replica()]
    c.collect_timeout = 0.0
    c._pending, c._collecting, c._adding, c._open = [[], []], {}, {}, {}
    c.router = PrefixRouter(2)
    c._stats, c._stats_at, c._delivered_since_stats = [EngineStats(), EngineStats()], 0.0, False
    return c


def test_the_replica_counts_read_at_the_end_add_up_to_every_request(client):
    for i in range(36):
        client.add_request(f"r{i}", [i] * 40, None)
    assert client.stats.requests_finished == 0  # read while they run: the clock starts
    outputs = []
    while client.has_unfinished_requests():
        outputs += client.step()
    assert len(outputs) == 36
    per_replica = client.replica_stats()  # well within a second of the last read
    assert sum(r["requests_finished"] for r in per_replica) == 36
    assert all(r["requests_finished"] > 0 for r in per_replica)
    assert client.stats.requests_finished == 36
