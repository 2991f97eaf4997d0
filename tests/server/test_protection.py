"""Auth, health, metrics, version, and client disconnects freeing the engine."""

import logging

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, engine_idle, wait_for

pytestmark = pytest.mark.slow

LONG = [{"role": "user", "content": "Write a very long essay about the history of France, "
                                    "from the Gauls to the present day."}]


def aborted(state) -> float:
    return state.metrics.value("batchrun_requests_finished_total", source="api",
                               finish_reason="abort")


def test_missing_or_wrong_key_is_401_in_openai_shape(api):
    for key in ("wrong-key", API_KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            api.client(api_key=key).models.list()
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key"
        assert e.value.body["type"] == "invalid_request_error"
    r = httpx.get(api.base_url + "/models")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(api.base_url + "/files")  # before any body parsing
    assert r.status_code == 401


def test_docs_and_unknown_routes_need_the_key(api):
    for path in ("/docs", "/redoc", "/openapi.json", "/nowhere"):
        r = httpx.get(api.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/docs", "/redoc"):
        assert httpx.get(api.url + path, headers=auth).status_code == 200
    assert "/v1/chat/completions" in httpx.get(api.url + "/openapi.json", headers=auth).json()[
        "paths"]
    assert httpx.get(api.url + "/nowhere", headers=auth).status_code == 404


def test_health_version_and_metrics_need_no_key(api):
    assert httpx.get(api.url + "/health").json() == {"status": "ok"}
    assert httpx.get(api.url + "/version").json()["version"]
    api.client().chat.completions.create(model="smollm2-135m", max_tokens=3,
                                         messages=[{"role": "user", "content": "Hi"}])
    text = httpx.get(api.url + "/metrics").text
    for name in ("batchrun_http_requests_total", "batchrun_prompt_tokens_total",
                 "batchrun_generation_tokens_total", "batchrun_time_to_first_token_seconds_bucket",
                 "batchrun_inter_token_latency_seconds_count", "batchrun_num_requests_running",
                 "batchrun_num_requests_waiting", "batchrun_kv_cache_usage_ratio",
                 "batchrun_prefix_cache_hit_rate"):
        assert name in text, name
    assert ('batchrun_http_requests_total{method="POST",route="/v1/chat/completions",'
            'status="200"}') in text


def scrape(api) -> dict[tuple[str, tuple], float]:
    """/metrics parsed: (sample name, sorted labels) -> value."""
    r = httpx.get(api.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_parse_and_move_after_a_request(api):
    chat = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    api_source = (("source", "api"),)
    before = scrape(api)
    api.client().chat.completions.create(model="smollm2-135m", max_tokens=4, messages=[
        {"role": "user", "content": "Count to ten."}])
    after = scrape(api)

    def moved(name, labels):
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    assert moved("batchrun_http_requests_total", chat) == 1
    assert moved("batchrun_http_request_duration_seconds_count", chat[:2]) == 1
    assert moved("batchrun_http_request_duration_seconds_sum", chat[:2]) > 0
    assert moved("batchrun_time_to_first_token_seconds_count", api_source) == 1
    assert moved("batchrun_request_latency_seconds_count", api_source) == 1
    assert moved("batchrun_request_latency_seconds_bucket", api_source + (("le", "+Inf"),)) == 1
    assert moved("batchrun_prompt_tokens_total", api_source) > 0
    assert 0 < moved("batchrun_generation_tokens_total", api_source) <= 4
    assert after[("batchrun_engine_alive", ())] == 1
    assert 0 <= after[("batchrun_kv_cache_usage_ratio", ())] <= 1


def test_client_errors_are_logged_on_one_line_without_the_body(api, caplog):
    caplog.set_level(logging.INFO, logger="batchrun.server.error_log")
    client = api.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", temperature=5, messages=[
            {"role": "user", "content": "the secret is hunter2"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        api.client(api_key="wrong").models.list()
    httpx.get(api.base_url + "/files/file-none%0Aforged line", headers={
        "Authorization": f"Bearer {API_KEY}"})
    client.models.list()  # a 200: not logged
    lines = [r.getMessage() for r in caplog.records if r.name == "batchrun.server.error_log"]
    assert len(lines) == 4, lines
    assert lines[0].startswith("POST /v1/chat/completions 400 invalid_value param=temperature: ")
    assert "temperature" in lines[0].split(": ", 1)[1]  # the message itself
    assert lines[1].startswith("POST /v1/chat/completions 404 model_not_found param=model: ")
    assert lines[2] == ("GET /v1/models 401 invalid_api_key param=-: Incorrect API key provided. "
                        "Pass it as 'Authorization: Bearer <key>'.")
    assert lines[3].startswith("GET /v1/files/file-none\\x0aforged line 404 not_found "
                               "param=file_id: ")
    assert all("\n" not in line for line in lines) and "hunter2" not in caplog.text


def test_disconnect_mid_stream_aborts_and_frees_kv(api):
    engine = api.state.model.engine
    before = aborted(api.state)
    body = {"model": "smollm2-135m", "messages": LONG, "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", api.base_url + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        contents = 0
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                contents += 1
            if contents >= 3:
                break
        assert engine.has_unfinished_requests()
    assert wait_for(lambda: engine_idle(engine), timeout=20)
    assert aborted(api.state) == before + 1


def test_disconnect_while_waiting_for_a_non_stream_answer(api):
    engine = api.state.model.engine
    before = aborted(api.state)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api.base_url + "/chat/completions", timeout=1.5,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "smollm2-135m", "messages": LONG, "max_tokens": 1000})
    assert wait_for(lambda: engine_idle(engine), timeout=20)
    assert aborted(api.state) == before + 1
