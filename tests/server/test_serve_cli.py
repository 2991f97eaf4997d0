"""`batchrun serve` as a user starts it: a subprocess on a free loopback port, key from the env."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_command_answers_and_stops_on_sigint(tmp_path):
    port = free_port()
    env = dict(os.environ, BATCHRUN_API_KEY="sk-cli", BATCHRUN_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "serve", "--port", str(port), "--data-dir",
         str(tmp_path), "--served-model-name", "smol", "--max-num-seqs", "8",
         "--read-timeout", "5", "--timeout-keep-alive", "2", "--max-connections", "16"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.3)
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-cli"}).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "serving smol on" in out


def test_serve_rejects_an_unknown_parser():
    proc = subprocess.run([sys.executable, "-m", "batchrun", "serve", "--reasoning-parser", "x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown reasoning parser" in proc.stderr


@pytest.mark.parametrize("args, env_key", [(["--api-key", ""], None), (["--api-key", "  "], None),
                                           ([], ""), ([], " \t"), ([], " sk-padded ")])
def test_serve_refuses_a_key_that_cannot_work(args, env_key):
    env = dict(os.environ)
    env.pop("BATCHRUN_API_KEY", None)
    if env_key is not None:
        env["BATCHRUN_API_KEY"] = env_key
    proc = subprocess.run([sys.executable, "-m", "batchrun", "serve", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--api-key" in proc.stderr and "API key" in proc.stderr
    assert "serving" not in proc.stderr
