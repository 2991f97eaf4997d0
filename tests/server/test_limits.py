"""Limits and engine death, each on a server of its own (so not next to the module `api` server:
one engine, one driver)."""

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, engine_idle, serve, wait_for
from tests.server.test_protection import LONG

pytestmark = pytest.mark.slow


def test_body_limit_and_queue_bound(real_model, tmp_path):
    with serve(real_model, tmp_path, max_body_bytes=2000, max_queued_requests=1) as srv:
        client = srv.client()
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="smollm2-135m", max_tokens=2, messages=[
                {"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        # A chunked body carries no content-length: the limit still holds.
        r = httpx.post(srv.base_url + "/chat/completions", content=iter([b"{" + b" " * 3000]),
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 413
        body = {"model": "smollm2-135m", "messages": LONG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
            lines = r.iter_lines()  # held: an abandoned iterator closes the connection
            next(lines)  # the first request is in the engine
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model="smollm2-135m", max_tokens=2,
                                               messages=[{"role": "user", "content": "Hi"}])
            assert e.value.body["code"] == "queue_full"
        assert wait_for(lambda: engine_idle(real_model.engine), timeout=20)


def test_health_is_503_once_the_engine_died(real_model, tmp_path, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    with serve(real_model, tmp_path) as srv:
        monkeypatch.setattr(real_model.engine, "step", broken_step)
        with pytest.raises(openai.APIStatusError) as e:
            srv.client().chat.completions.create(model="smollm2-135m", max_tokens=2,
                                                 messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_dead"
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "device lost" in r.json()["detail"]
        with pytest.raises(openai.APIStatusError) as e:
            srv.client().chat.completions.create(model="smollm2-135m", max_tokens=2,
                                                 messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 503
    monkeypatch.undo()
    # The request that was in the engine when it died: leave the shared engine clean.
    for request_id in list(real_model.engine.groups):
        real_model.engine.abort_request(request_id)
    assert engine_idle(real_model.engine)
