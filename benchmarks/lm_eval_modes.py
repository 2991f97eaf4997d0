"""The quality gate's lm-eval half: one lm-eval multiple-choice task through `batchrun serve`, for
each reduced-precision mode, against float32 on the same weights.

    python benchmarks/lm_eval_modes.py --modes none:bfloat16,bf16,int8 [--limit N]

Data: the installed lm-eval ships no task data (its tasks download from the Hugging Face hub),
but its MMLU `flan_cot_fewshot` task files hold 5 solved questions per subject (281 with an answer
letter): they are written as a local JSON task (`br_mmlu_shots`: the subject line, the question,
"Answer:", each choice's text scored as the continuation: on MMLU's A-D letter prompt the
bundled 135M model scored 25.0% with the same picks in every mode, which tells modes nothing),
read with the hub off.
Each mode (QUANTIZATION[:DTYPE], as benchmarks/quality.py takes) runs `batchrun serve` on a free
port and lm-eval's `local-completions` model against it (loglikelihood requests:
prompt_logprobs), then stops it. Reported per mode: accuracy, and the share of questions whose
pick (the answer with the highest loglikelihood) is float32's pick.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.quality import REFERENCE, parse_mode  # noqa: E402
from benchmarks.scoring import mmlu_questions  # noqa: E402

TASK = "br_mmlu_shots"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{description}}}}\\n\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_task(folder: Path) -> int:
    """The task's YAML and data in `folder`; returns how many questions."""
    rows = [{"description": d, "question": q, "choices": c, "answer": a}
            for d, q, c, a in mmlu_questions() if a is not None]
    data = folder / "mmlu_shots.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return len(rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(mode: str, data_dir: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    """`batchrun serve` in `mode` on a free port, once /health answers."""
    import httpx

    port, m = free_port(), parse_mode(mode)
    env = {k: v for k, v in os.environ.items() if k != "BATCHRUN_API_KEY"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads:
        env["BATCHRUN_THREADS"] = str(threads)
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "serve", "--port", str(port),
                             "--data-dir", str(data_dir), "--quantization", m["quantization"],
                             "--dtype", m["dtype"]], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 1800  # int8's first load calibrates (minutes on a loaded machine)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"batchrun serve ({mode}) exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.terminate()
            raise SystemExit(f"batchrun serve ({mode}) did not come up")
        time.sleep(0.5)


def evaluate(url: str, tasks: Path, tokenizer: str, limit: int | None) -> list[tuple[int, int, int]]:
    """(doc id, pick, answer) per question through local-completions."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (f"base_url={url}/v1/completions,model=smollm2-135m,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(tasks)),
                                  log_samples=True, batch_size=8, limit=limit)
    picks = []
    for s in sorted(out["samples"][TASK], key=lambda s: s["doc_id"]):
        lls = [float(ll) for ll, _ in s["filtered_resps"]]
        picks.append((s["doc_id"], lls.index(max(lls)), int(s["target"])))
    return picks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none:bfloat16,bf16,int8",
                    help=f"comma list of QUANTIZATION[:DTYPE] compared with {REFERENCE}")
    ap.add_argument("--limit", type=int, default=None, help="questions (default: all 281)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out

    from batchrun.models.weights.resolve import resolve_model
    from benchmarks.bench import machine_line

    tokenizer = str(resolve_model(None).path)
    modes = [REFERENCE] + [m for m in args.modes.split(",") if m and m != REFERENCE]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp) / "tasks"
        tasks.mkdir()
        total = write_task(tasks)
        for mode in modes:
            proc, url = serve(mode, Path(tmp) / mode.replace(":", "_"), args.threads)
            try:
                start = time.perf_counter()
                results[mode] = evaluate(url, tasks, tokenizer, args.limit)
                print(f"{mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    ref = {doc: pick for doc, pick, _ in results[REFERENCE]}
    n = len(ref)
    print(f"lm-eval {TASK} (MMLU's {total} few-shot exemplars, 0-shot, choice texts scored), "
          f"{n} questions through batchrun serve + local-completions")
    print(f"{'mode':<26}{'acc':>8}{'same pick as fp32':>20}")
    for mode, picks in results.items():
        acc = sum(p == a for _, p, a in picks) / n
        same = sum(ref[doc] == p for doc, p, _ in picks) / n
        print(f"{mode:<26}{acc:>8.2%}{same:>20.2%}")
    print(machine_line())


if __name__ == "__main__":
    main()
