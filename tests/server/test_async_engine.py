"""AsyncEngine on a tiny random model: streaming, abort, priorities, sync clients, failed steps,
engine death."""

import asyncio
import threading

import pytest

from batchrun.engine import SamplingParams
from batchrun.engine.async_engine import MAX_FAILED_STEPS, AsyncEngine
from batchrun.engine.errors import EngineDeadError, QueueFullError
from batchrun.engine.sync_client import SyncEngineClient
from tests.helpers import tiny_engine

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def engine(tmp_path):
    _, eng = tiny_engine("llama", tmp_path, num_blocks=64)
    return eng


@pytest.fixture
def ae(engine):
    finished = []
    ae = AsyncEngine(engine, max_queued=4, on_finished=lambda o, s: finished.append((o, s)))
    ae.finished = finished
    ae.start()
    yield ae
    ae.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_generate_matches_the_sync_engine(engine, tmp_path):
    prompt = list(range(3, 20))
    ref = engine.generate([prompt], LONG)[0].outputs[0].token_ids
    ae = AsyncEngine(engine).start()
    try:
        async def go():
            outs = [o async for o in ae.generate("r", prompt, LONG, stream=True)]
            return outs
        outs = run(go())
    finally:
        ae.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and len(outs) > 1  # cumulative, several updates


def test_closing_a_stream_aborts_and_frees_blocks(ae):
    async def go():
        stream = ae.generate("r", list(range(3, 30)), SamplingParams(temperature=0, max_tokens=200,
                                                                      ignore_eos=True), stream=True)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        stream.close()
        for _ in range(200):
            if not ae.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
    run(go())
    assert not ae.engine.has_unfinished_requests()
    assert ae.engine.kv.num_free_blocks == ae.engine.kv.num_blocks
    assert ae.finished[-1][0].outputs[0].finish_reason == "abort"


def test_queue_bound_and_engine_refusals(ae):
    async def go():
        with pytest.raises(ValueError, match="context length"):
            await ae.generate("too-long", list(range(3, 300)), LONG).result()
        streams = [ae.generate(f"r{i}", [5, 6, 7], LONG) for i in range(4)]
        with pytest.raises(QueueFullError):
            ae.generate("r-extra", [5, 6, 7], LONG)
        results = await asyncio.gather(*(s.result() for s in streams))
        return results
    results = run(go())
    assert all(len(r.outputs[0].token_ids) == 40 for r in results)
    assert {s for _, s in ae.finished} == {"api"}


def test_sync_client_runs_next_to_async_requests(ae):
    client = SyncEngineClient(ae)
    client.add_request("b1", [7, 8, 9],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    client.add_request("b2", list(range(3, 300)), LONG)  # refused by the engine: a failed output
    outs = {}
    while client.has_unfinished_requests():
        for o in client.step(timeout=30):
            outs[o.request_id] = o
    assert outs["b1"].outputs[0].finish_reason == "length" and not outs["b1"].error
    assert "context length" in outs["b2"].error
    assert (client.num_ok, client.num_failed) == (1, 1)


def test_sync_client_wake_unblocks_step(ae):
    client = SyncEngineClient(ae)
    threading.Timer(0.2, client.wake).start()
    # Nothing is in flight, so only the wake can end this wait (no race with the engine).
    assert client.step(timeout=30) == []
    assert not client.has_unfinished_requests()


def test_a_failed_step_fails_the_requests_in_the_engine_and_the_engine_serves_on(ae, monkeypatch,
                                                                               caplog):
    real_step = ae.engine.step
    failed = []

    def flaky_step():
        if not failed and {"a", "b"} <= set(ae.engine.groups):  # once, with both requests in
            failed.append(True)
            raise RuntimeError("kernel exploded")
        return real_step()
    monkeypatch.setattr(ae.engine, "step", flaky_step)
    client = SyncEngineClient(ae)

    async def go():
        stream = ae.generate("a", [5, 6, 7], LONG, stream=True)
        client.add_request("b", [8, 9, 10], LONG)
        return [out async for out in stream][-1]
    out = run(go())
    assert out.finished and "kernel exploded" in out.error
    (batch_out,) = client.step(timeout=30)
    assert batch_out.request_id == "b" and "kernel exploded" in batch_out.error
    assert (client.num_ok, client.num_failed) == (0, 1)
    assert ae.engine.kv.num_free_blocks == ae.engine.kv.num_blocks
    assert ae.is_alive

    async def again():
        return await ae.generate("c", [5, 6, 7], LONG).result()
    after = run(again())
    assert after.error is None and len(after.outputs[0].token_ids) == 40
    assert any(r.exc_info and "a step failed" in r.getMessage() for r in caplog.records)


def test_an_engine_that_keeps_failing_dies(ae, monkeypatch):
    def boom():
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(ae.engine, "step", boom)

    async def go():
        for i in range(MAX_FAILED_STEPS - 1):
            out = await ae.generate(f"r{i}", [5, 6, 7], LONG).result()
            assert "kernel exploded" in out.error
        with pytest.raises(EngineDeadError):
            await ae.generate("last", [5, 6, 7], LONG).result()
    run(go())
    assert not ae.is_alive and "kernel exploded" in repr(ae.dead)
    with pytest.raises(EngineDeadError):
        ae.check_alive()
