"""Scoring throughput: every prompt token's logprob, batchrun's engine against transformers'
batched forward pass on the same token ids, side by side in one run.

    python benchmarks/scoring.py --questions 64 --shots 0

The workload is multiple choice as evaluation harnesses score it: each question (MMLU's few-shot
questions that lm-eval ships in its task files) is scored once per answer choice, so the four
prompts share the question, and with --shots k also k solved questions of the same subject in
front of it. Figures are prompt tokens scored per second. batchrun runs prompt_logprobs=1 and
max_tokens=0 (what lm-eval's local-completions asks for), with its prefix cache and without it;
transformers runs right-padded batches of --hf-batch prompts sorted by length and takes each
target's logit minus its row's logsumexp (log_softmax at the targets). The largest difference
between the two systems' logprobs is printed too, so a figure never comes from wrong answers.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import subprocess
import time

import torch
import yaml

CHOICE = re.compile(r"\(([A-D])\) ")
ANSWER = re.compile(r"answer is \(([A-D])\)")


def mmlu_questions() -> list[tuple[str, str, list[str], int | None]]:
    """(subject description, question stem, four choices, the answer's index) from lm-eval's
    MMLU CoT task files (their worked answers end "The answer is (X)."; None where not)."""
    import lm_eval

    root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "mmlu", "flan_cot_fewshot")
    out = []
    for path in sorted(glob.glob(os.path.join(root, "mmlu_*.yaml"))):
        with open(path) as f:
            spec = yaml.safe_load(f)
        for sample in spec.get("fewshot_config", {}).get("samples", []):
            parts = CHOICE.split(sample["question"])
            answer = ANSWER.search(sample.get("target", ""))
            if len(parts) != 9:  # stem, then (letter, text) x 4
                continue
            stem = parts[0].strip()
            choices = [parts[i].strip() for i in (2, 4, 6, 8)]
            out.append((spec["description"].strip(), stem, choices,
                        answer and "ABCD".index(answer.group(1))))
    return out


def workload(tokenizer, questions: int, shots: int) -> list[list[int]]:
    items = mmlu_questions()
    by_subject: dict[str, list] = {}
    for item in items:
        by_subject.setdefault(item[0], []).append(item)
    prompts = []
    for description, stem, choices, _ in items:
        same = [q for q in by_subject[description] if q[1] != stem][:shots]
        shot_text = "".join(f"Question: {s}\nAnswer: {c[0]}\n\n" for _, s, c, _ in same)
        context = f"{description}\n\n{shot_text}Question: {stem}\nAnswer:"
        for choice in choices:
            prompts.append(tokenizer(context + " " + choice)["input_ids"])
        if len(prompts) >= 4 * questions:
            break
    return prompts


def run_batchrun(model, prompts, prefix_caching: bool):
    from batchrun.engine import SamplingParams

    engine = model.engine
    engine.kv.reset_prefix_cache()
    engine.kv.enable_prefix_caching = prefix_caching
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    engine.generate([prompts[0][:8]], params)  # warm-up (kernels, allocator)
    engine.kv.reset_prefix_cache()
    cached_before = engine.stats.cached_tokens
    prompt_before = engine.stats.prompt_tokens
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    hit = (engine.stats.cached_tokens - cached_before) / max(
        1, engine.stats.prompt_tokens - prompt_before)
    engine.kv.enable_prefix_caching = True
    return seconds, [torch.tensor(o.prompt_logprobs.logprob[1:]) for o in outs], hit


@torch.inference_mode()
def run_hf(hf, prompts, batch: int):
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    result: list = [None] * len(prompts)
    hf(input_ids=torch.tensor([prompts[0]]))  # warm-up
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, :len(prompts[i])] = 1
        logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        # log_softmax at the targets only: the same values, without a second [B, L, V] tensor.
        picked = logits.gather(2, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
        for row, i in enumerate(idx):
            result[i] = picked[row, :len(prompts[i]) - 1].clone()
    return time.perf_counter() - start, result


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name"))
        flags = out.split("Flags:", 1)[1] if "Flags:" in out else ""
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "AVX512-BF16"),
                                          ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"))
                  if flag in flags.split()]
        return f"{model} ({' + '.join([isa, *extras])}), {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="batchrun model (default: the bundled one)")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--shots", type=int, default=0, help="solved questions before each one")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for both systems (default: all); 1 is steadier on a "
                         "machine other jobs share")
    args = ap.parse_args()
    if args.threads:
        os.environ["BATCHRUN_THREADS"] = str(args.threads)

    from transformers import AutoModelForCausalLM

    from batchrun import llm

    model = llm.load(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    prompts = workload(model.tokenizer, args.questions, args.shots)
    scored = sum(len(p) - 1 for p in prompts)
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}")
    print(f"workload: {len(prompts) // 4} questions x 4 choices, {args.shots}-shot, "
          f"{scored} prompt tokens to score (mean prompt {scored / len(prompts) + 1:.0f} tokens)")

    hf_s, ref = run_hf(hf, prompts, args.hf_batch)
    rows = [("transformers forward (batch %d)" % args.hf_batch, hf_s, None, ref)]
    for caching in (True, False):
        seconds, ours, hit = run_batchrun(model, prompts, caching)
        name = "batchrun " + ("(prefix cache)" if caching else "(no prefix cache)")
        rows.append((name, seconds, hit, ours))
    print(f"{'system':34s} {'seconds':>8s} {'tokens/s':>9s} {'vs hf':>6s} {'cache hit':>9s} "
          f"{'max |dlogprob|':>14s}")
    for name, seconds, hit, values in rows:
        diff = max(float((a - b).abs().max()) if len(a) else 0.0 for a, b in zip(values, ref))
        print(f"{name:34s} {seconds:8.2f} {scored / seconds:9.0f} {hf_s / seconds:5.2f}x "
              f"{'' if hit is None else f'{hit:.0%}':>9s} {diff:14.2e}")


if __name__ == "__main__":
    main()
