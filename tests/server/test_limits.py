"""Limits and engine death, each on a server of its own (so not next to the module `api` server:
one engine, one driver)."""

import json
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, engine_idle, serve, wait_for
from tests.server.test_protection import LONG

pytestmark = pytest.mark.slow


def test_body_limit_and_queue_bound(real_model, tmp_path):
    with serve(real_model, tmp_path, max_body_size=2000, max_queued_requests=1) as srv:
        client = srv.client()
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="smollm2-135m", max_tokens=2, messages=[
                {"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        # A chunked body carries no content-length: the limit still holds.
        r = httpx.post(srv.base_url + "/chat/completions", content=iter([b"{" + b" " * 3000]),
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 413
        # Two prompts are two engine requests: never fitting one slot, they are a 400, not a
        # 429 its client would retry forever.
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2-135m", prompt=["a", "b"], max_tokens=1)
        assert e.value.body["param"] == "prompt" and "--max-queued-requests" in e.value.message
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


def test_a_failed_step_is_a_500_for_its_requests_and_the_server_serves_on(real_model, tmp_path,
                                                                           monkeypatch):
    real_step = real_model.engine.step
    failed = []

    def flaky_step():
        if not failed:
            failed.append(True)
            raise RuntimeError("a bad step")
        return real_step()

    hi = [{"role": "user", "content": "Hi"}]
    with serve(real_model, tmp_path) as srv:
        monkeypatch.setattr(real_model.engine, "step", flaky_step)
        with pytest.raises(openai.InternalServerError) as e:
            srv.client().chat.completions.create(model="smollm2-135m", max_tokens=2, messages=hi)
        assert e.value.body["code"] == "engine_error" and "a bad step" in e.value.body["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        out = srv.client().chat.completions.create(model="smollm2-135m", max_tokens=2, messages=hi)
        assert out.choices[0].finish_reason == "length"
    assert engine_idle(real_model.engine)


def test_health_is_503_once_the_engine_died(real_model, tmp_path, monkeypatch):
    from batchrun.engine.async_engine import MAX_FAILED_STEPS

    def broken_step():
        raise RuntimeError("device lost")

    hi = [{"role": "user", "content": "Hi"}]
    with serve(real_model, tmp_path) as srv:
        monkeypatch.setattr(real_model.engine, "step", broken_step)
        statuses = []
        for _ in range(MAX_FAILED_STEPS + 1):
            with pytest.raises(openai.APIStatusError) as e:
                srv.client().chat.completions.create(model="smollm2-135m", max_tokens=2,
                                                     messages=hi)
            statuses.append((e.value.status_code, e.value.body["code"]))
        # Each failed step fails its request; the engine is dead once they keep failing.
        assert statuses == [(500, "engine_error")] * (MAX_FAILED_STEPS - 1) + [
            (503, "engine_dead")] * 2
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "device lost" in r.json()["detail"]
    monkeypatch.undo()
    # The request that was in the engine when it died: leave the shared engine clean.
    for request_id in list(real_model.engine.groups):
        real_model.engine.abort_request(request_id)
    assert engine_idle(real_model.engine)


def _connect(srv, data=b""):
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def _closed_after(sock) -> float:
    """Seconds until the server closes `sock` (what it sent before is read and dropped)."""
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


def test_incomplete_requests_are_closed_after_the_read_timeout(real_model, tmp_path, caplog):
    partial = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    unfinished_body = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                       + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    with serve(real_model, tmp_path, read_timeout=1.0) as srv:
        opened = time.monotonic()
        socks = [_connect(srv) for _ in range(20)] + [_connect(srv, partial) for _ in range(20)]
        socks.append(_connect(srv, unfinished_body))
        kept_alive = _connect(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b'{"status":"ok"}' in kept_alive.recv(65536)
        kept_alive.sendall(partial)
        socks.append(kept_alive)
        assert httpx.get(srv.url + "/health").status_code == 200  # complete requests are served
        for sock in socks:
            _closed_after(sock)
            sock.close()
        assert 0.9 <= time.monotonic() - opened < 5
        assert wait_for(lambda: not srv.server.server_state.connections, timeout=5)
        assert "unhandled error" not in caplog.text  # the cut-off body is no server error

        # The timeout is per pause: a body sent slowly but steadily takes longer, and is served.
        body = json.dumps({"model": "smollm2-135m", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        step = len(body) // 6 + 1

        def trickle():
            for i in range(0, len(body), step):
                time.sleep(0.4)
                yield body[i:i + step]

        started = time.monotonic()
        r = httpx.post(srv.base_url + "/chat/completions", content=trickle(), timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}",
                                "Content-Length": str(len(body))})
        assert r.status_code == 200 and r.json()["choices"]
        assert time.monotonic() - started > 2.0


def test_connection_limit_and_keep_alive_timeout(real_model, tmp_path):
    with serve(real_model, tmp_path, max_connections=4, timeout_keep_alive=0.5) as srv:
        state = srv.server.server_state
        idle = [_connect(srv) for _ in range(4)]
        assert wait_for(lambda: len(state.connections) == 4, timeout=10)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503
        idle.pop().close()
        assert wait_for(lambda: len(state.connections) == 3, timeout=10)
        assert httpx.get(srv.url + "/health").status_code == 200
        for sock in idle:
            sock.close()
        kept_alive = _connect(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert 0.4 <= _closed_after(kept_alive) < 5
        kept_alive.close()
