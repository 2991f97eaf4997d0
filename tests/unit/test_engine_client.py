"""The EngineClient Protocol (batchrun/engine/client.py) against its three implementations:
the Engine, the SyncEngineClient of an AsyncEngine and the tests' FakeEngine. A method whose
parameters drift from the Protocol's fails here."""

import inspect

import pytest

from batchrun.engine.async_engine import AsyncEngine
from batchrun.engine.client import EngineClient, EngineStats
from batchrun.engine.engine import Engine
from batchrun.engine.sync_client import SyncEngineClient
from tests.fake_engine import FakeEngine
from tests.helpers import tiny_engine

IMPLEMENTATIONS = [Engine, SyncEngineClient, FakeEngine]
# Parameters an implementation has beyond the Protocol's (all optional, at the end).
EXTRA = {(SyncEngineClient, "step"): ["timeout"]}


def protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(EngineClient).items()
                  if callable(value) and not name.startswith("_"))


def shape(fn) -> list[tuple[str, str, bool]]:
    """(name, kind, has a default) of each parameter."""
    return [(p.name, p.kind.name, p.default is not p.empty)
            for p in inspect.signature(fn).parameters.values()]


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    _, engine = tiny_engine("llama", tmp_path_factory.mktemp("tiny"), num_blocks=16)
    return {Engine: engine, SyncEngineClient: SyncEngineClient(AsyncEngine(engine)),
            FakeEngine: FakeEngine()}


def test_the_protocol_lists_what_callers_use():
    assert protocol_methods() == ["abort_request", "add_request", "has_unfinished_requests",
                                  "step"]
    assert {name for name, value in vars(EngineClient).items()
            if isinstance(value, property)} == {"max_model_len", "stats"}


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_is_an_engine_client(cls, instances):
    client = instances[cls]
    assert isinstance(client, EngineClient)
    assert type(client.stats) is EngineStats
    assert isinstance(client.max_model_len, int) and client.max_model_len > 0


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", protocol_methods())
def test_method_signatures_match_the_protocol(cls, method):
    want = shape(getattr(EngineClient, method))
    got = shape(getattr(cls, method))
    extra = EXTRA.get((cls, method), [])
    assert [name for name, _, _ in got[len(want):]] == extra, f"{cls.__name__}.{method}"
    assert all(default for _, _, default in got[len(want):])
    assert got[:len(want)] == want, f"{cls.__name__}.{method}{inspect.signature(getattr(cls, method))}"


def test_a_missing_method_is_not_an_engine_client():
    class Partial:
        max_model_len = 8
        stats = EngineStats()

        def step(self):
            return []

    assert not isinstance(Partial(), EngineClient)
