"""`batchrun serve` as a user starts it: a subprocess on a free loopback port, key from the env."""

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers import ROOT, serve_cli


@pytest.mark.slow
def test_serve_command_answers_and_stops_on_sigint(tmp_path):
    env = {"BATCHRUN_API_KEY": "sk-cli", "BATCHRUN_THREADS": "1"}
    with serve_cli("--data-dir", tmp_path, "--served-model-name", "smol", "--max-num-seqs", "8",
                   "--read-timeout", "5", "--timeout-keep-alive", "2", "--max-connections", "16",
                   env=env, stop=signal.SIGINT) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        models = httpx.get(server.url + "/v1/models",
                           headers={"Authorization": "Bearer sk-cli"}).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
    assert server.proc.returncode == 0, server.output
    assert "serving smol on" in server.output


def test_serve_rejects_an_unknown_parser():
    proc = subprocess.run([sys.executable, "-m", "batchrun", "serve", "--reasoning-parser", "x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--reasoning-parser" in proc.stderr
    assert "'x' is not one of 'deepseek_r1', 'harmony', 'mimo', 'openai_gptoss', 'qwen3', " \
        "'think'" in proc.stderr


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


def test_serve_on_a_taken_port_fails_before_the_model_loads(tmp_path):
    import socket

    from click.testing import CliRunner

    from batchrun.server.cli import serve

    loaded = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(serve, ["--port", str(port), "--data-dir", str(tmp_path)],
                                    obj={"load_model": lambda *a: loaded.append(a)})
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "another process uses that port" in result.output
    assert loaded == []  # the model was never loaded
