"""Operator faults through the CLI on the fake engine: stdout closed under `-o -`, Ctrl-C
after the last line was read."""

import json
import signal
import subprocess
import sys
import time

from tests.helpers import ENV, ROOT


def request(custom_id, max_tokens):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": max_tokens}})


def test_stdout_closed_is_exit_1_with_a_message(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(request(f"r{i}", 2) for i in range(20)) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_batchrun", "run", src, "-o", "-",
                             "--progress", "none"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first record
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "stdout was closed before every record was written (broken pipe" in err
    assert "Traceback" not in err


def test_ctrl_c_after_the_last_line_was_read_exits_75_and_the_output_is_whole(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(request(f"r{i}", 20) for i in range(6)) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_batchrun", "run", src, "-o", out,
                             "--progress", "none", "--max-in-flight", "8"], cwd=ROOT,
                            env={**ENV, "BATCHRUN_FAKE_STEP_S": "0.1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # every line is in the engine once the run has started
        if line.startswith("running "):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 75, err
    assert "0 lines done, 6 in flight, 0 not started, of 6" in err
    assert "all 6 lines finished within the grace period and the output is complete" in err
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == \
        [f"r{i}" for i in range(6)]
    rerun = subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "run", src, "-o", out,
                            "--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 0 and "already completed" in rerun.stderr
