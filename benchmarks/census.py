"""A census of the model zoo: every architecture transformers' causal-LM mapping names (and, with
--image-text, its image-text-to-text mapping) built at tiny size with random weights, run greedy
through batchrun in-process (batchrun.llm.load_from_path, the path `batchrun run` takes) and
through transformers' `generate`, and classified:

  EXACT    the same greedy tokens on every prompt (a first difference where transformers' top-2
           logits are a numerical tie, below tests/parity.py's margin, counts as the same)
  CLOSE    the same first token everywhere, a later one differs somewhere
  SPLIT    transformers disagrees with itself: its generate and its own forward over the same
           tokens pick different greedy tokens (Moshi at a window below the prompt: generate's
           cache drops tokens the forward's causal mask keeps); batchrun's tokens are then held
           against the forward's, and any difference from those is DIFF / CLOSE as usual
  DIFF     the first token differs on some prompt
  REFUSED  batchrun refuses it (the reason's first line)
  CRASH    batchrun raised something else, or the worker died or hung (type + message)
  SKIP     not a candidate: encoder-decoder, or transformers itself cannot build it at tiny size
           or generate with it (the reason)

Each architecture runs in a worker subprocess, several per worker; one that hangs past
--timeout is killed and the rest go on in a fresh worker.

    PYTHONPATH=$PWD python benchmarks/census.py --out /tmp/census.json
    PYTHONPATH=$PWD python benchmarks/census.py --only bloom,falcon --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PROMPT_LENGTHS = (5, 11, 17, 3)
MAX_TOKENS = 8
TIE_MARGIN = 1e-3
MAX_PARAMETERS = 40_000_000  # the vocabulary alone is 2 x 49152 x 64
MAX_MEMORY = 6 << 30  # a worker's address space beyond torch's own reservations
# Config fields set small wherever a config has them (its own names or its attribute_map's).
SMALL = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "ffn_hidden_size": 128,
    "max_position_embeddings": 256, "initializer_range": 0.2,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "moe_num_experts": 4,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "sliding_window": 8, "attention_window_size": 8, "window_size": 8,
    "tie_word_embeddings": False, "use_cache": True,
    # sub-towers of multimodal configs
    "image_size": 32, "patch_size": 8, "num_channels": 3, "projection_dim": 64,
    "depth": 2, "embed_dim": 64, "out_hidden_size": 64,
}

# What the generic shrinking cannot guess.
EXTRA = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    # chunks and temperature steps the prompts cross (the defaults, 8192 each, exceed them),
    # and a NoPE layer beside the chunked one
    "llama4_text": {"attention_chunk_size": 8, "floor_scale": 4, "no_rope_layer_interval": 2},
    # Gemma 3n's last layers reuse the K/V of the last earlier layer of their kind
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                     "vocab_size_per_layer_input": 49152, "hidden_size_per_layer_input": 8},
    # hybrids whose attention layers the first two would miss
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2},  # heads x head_dim = 2 x hidden
}
# Encoder families whose causal-LM class (BertLMHeadModel, RobertaForCausalLM, ...) is a decoder only
# with is_decoder set, as those classes ask: built so (without it they are encoders, refused).


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The worker: one architecture at a time, a JSON line per result on stdout.

def shrunk_kwargs(cfg_cls, vocab_size: int | None = None) -> dict:
    """Keyword arguments that make `cfg_cls` tiny: SMALL's fields it has, head_dim from them, and
    its sub-configs (text_config, vision_config, ...) made tiny the same way."""
    default = cfg_cls()
    kwargs = {k: v for k, v in SMALL.items() if hasattr(default, k)}
    if vocab_size and hasattr(default, "vocab_size"):
        kwargs["vocab_size"] = vocab_size
    heads = kwargs.get("num_attention_heads", getattr(default, "num_attention_heads", None))
    hidden = kwargs.get("hidden_size", getattr(default, "hidden_size", None))
    settable = not isinstance(getattr(cfg_cls, "head_dim", None), property)
    if hasattr(default, "head_dim") and heads and hidden and settable:
        kwargs["head_dim"] = hidden // heads
    if heads and hidden:
        kwargs.update(rotary_sizes(default, hidden // heads))
    layers = getattr(default, "num_hidden_layers", None)
    if "num_hidden_layers" in kwargs and isinstance(layers, int):
        kept = kept_layers(default, layers, kwargs["num_hidden_layers"])
        kwargs["num_hidden_layers"] = len(kept)
        for key, value in vars(default).items():  # per-layer lists: the kept layers' entries
            if isinstance(value, list) and len(value) == layers and key not in kwargs:
                kwargs[key] = [value[i] for i in kept]
    if hasattr(default, "attn_layer_period"):  # Jamba, Zamba: attention at layer 1 of 2
        kwargs.update(attn_layer_period=2, attn_layer_offset=1)
    if hasattr(default, "expert_layer_period"):
        kwargs.update(expert_layer_period=2, expert_layer_offset=1)
    if getattr(default, "kv_lora_rank", None) and "num_attention_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA: one K/V per head
    kwargs.update(EXTRA.get(getattr(cfg_cls, "model_type", ""), {}))
    if getattr(default, "is_decoder", None) is False and not getattr(default, "is_encoder_decoder", False):
        kwargs["is_decoder"] = True
    if isinstance(getattr(default, "num_key_value_heads", None), int) is False:
        kwargs.pop("num_key_value_heads", None)
    for key in getattr(cfg_cls, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if hasattr(sub, "to_dict"):  # a sub-config (its class, where the mapping says AutoConfig)
            try:
                kwargs[key] = {"model_type": sub.model_type,
                               **shrunk_kwargs(type(sub), vocab_size if key == "text_config" else None)}
            except Exception as exc:  # a sub-config that will not build alone: left default
                log(f"{cfg_cls.__name__}.{key}: not shrunk ({first_line(exc)})")
    return kwargs


def rotary_sizes(default, head_dim: int) -> dict:
    """Rotary sizes that fit a head of `head_dim`: GPT-J's rotary_dim, and multimodal RoPE's
    sections (Qwen2-VL's, which must sum to half a head) scaled down in proportion."""
    out: dict = {}
    if getattr(default, "rotary_dim", None):
        out["rotary_dim"] = min(default.rotary_dim, head_dim)
    rope = getattr(default, "rope_parameters", None)
    # a vision-language text model's multimodal RoPE, whose sections its rotary code defaults
    mrope = isinstance(rope, dict) and any(k in str(getattr(default, "model_type", ""))
                                           for k in ("vl", "ocr", "glm4v"))
    if isinstance(rope, dict) and (rope.get("mrope_section") or mrope):
        partial = rope.get("partial_rotary_factor", getattr(default, "partial_rotary_factor", 1))
        sections = rope.get("mrope_section") or [16, 24, 24]
        half = int(head_dim * (partial or 1)) // 2
        scaled = [max(1, s * half // sum(sections)) for s in sections]
        scaled[0] += half - sum(scaled)
        out["rope_parameters"] = {**rope, "mrope_section": scaled}
    return out


# The per-layer lists whose kinds the kept layers must cover (a hybrid's attention and its
# recurrent layers: transformers' generate needs an attention layer to count its cache).
KIND_LISTS = ("layer_types", "layers_block_type", "block_types")


def kept_layers(default, layers: int, wanted: int) -> list[int]:
    """Which of the default config's layers the tiny one keeps: the first `wanted`, or more to
    keep the first layer of each kind its per-layer kinds name."""
    kinds = next((getattr(default, k) for k in KIND_LISTS
                  if isinstance(getattr(default, k, None), list)
                  and len(getattr(default, k)) == layers), None)
    if kinds is None:
        return list(range(min(wanted, layers)))
    first = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    rest = [i for i in range(layers) if i not in first]
    return sorted(first + rest[:max(0, wanted - len(first))])


def build(model_type: str, class_name: str, folder: Path, vocab_size: int):
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[model_type]
    cfg = cfg_cls(**shrunk_kwargs(cfg_cls, vocab_size))
    text = cfg.get_text_config()
    text.vocab_size = vocab_size
    for c in {id(cfg): cfg, id(text): text}.values():
        c.bos_token_id, c.eos_token_id, c.pad_token_id = 1, 2, 0
    if getattr(cfg, "is_encoder_decoder", False):
        raise SkipArch("encoder-decoder")
    with torch.device("meta"):  # sized first: a config the shrinking missed is skipped
        size = sum(p.numel() for p in getattr(transformers, class_name)(cfg).parameters())
    if size > MAX_PARAMETERS:
        raise SkipArch(f"build: {size / 1e6:.0f}M parameters at 'tiny' size (the generic "
                       f"shrinking missed some of its sizes)")
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(cfg).eval()
    model.save_pretrained(folder)
    return model


class SkipArch(Exception):
    pass


def hf_greedy(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    margins = [float(l[0].float().topk(2).values.diff().abs()) for l in out.logits]
    return out.sequences[0, len(prompt):].tolist(), margins


def loop_greedy(model, prompt):
    """hf_greedy's tokens and margins from the full forward at each step (no cache)."""
    import torch

    tokens, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            margins.append(float(logits.topk(2).values.diff().abs()))
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], margins


def forward_greedy(model, prompt, ref) -> list | None:
    """The forward's greedy picks over prompt + generate's tokens, where they differ from
    generate's (None: generate agrees with its own forward)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1:-1].float()
    picks = logits.argmax(-1).tolist()
    top2 = logits.topk(2, dim=-1).values
    split = [i for i, (a, b) in enumerate(zip(picks, ref))
             if a != b and float(top2[i, 0] - top2[i, 1]) >= TIE_MARGIN]
    return None if not split else picks


def compare(ours: list, ref: list, margins: list) -> tuple[int | None, bool]:
    """(first differing position or None, whether it is a tie in the reference)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i, margins[i] < TIE_MARGIN
    return (None, False) if len(ours) == len(ref) else (min(len(ours), len(ref)), False)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def census_one(model_type: str, class_name: str, tokenizer, root: Path) -> dict:
    import torch

    from batchrun import llm
    from batchrun.engine import SamplingParams
    from batchrun.options.engine import EngineConfig

    row = {"arch": model_type, "class": class_name}
    folder = root / model_type
    try:
        hf = build(model_type, class_name, folder, len(tokenizer))
    except SkipArch as exc:
        return {**row, "status": "SKIP", "reason": str(exc)}
    except Exception as exc:
        return {**row, "status": "SKIP", "reason": "build: " + first_line(exc)}
    tokenizer.save_pretrained(folder)
    vocab = hf.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, min(vocab, 500), (n,), generator=gen).tolist()
               for n in PROMPT_LENGTHS]
    try:
        refs = [hf_greedy(hf, p) for p in prompts]
    except Exception as exc:  # generate fails (Llama 4's VLM on text): its forward, step by step
        try:
            refs = [loop_greedy(hf, p) for p in prompts]
        except Exception:
            return {**row, "status": "SKIP", "reason": "generate: " + first_line(exc)}
        row["reference"] = "forward (generate: " + first_line(exc) + ")"
    config = EngineConfig.default(device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    try:
        loaded = llm.load_from_path(folder, config)
    except ValueError as exc:  # UnsupportedModelError, ModelFolderError: refusals with a reason
        return {**row, "status": "REFUSED", "reason": first_line(exc)}
    except Exception as exc:
        return {**row, "status": "CRASH", "reason": first_line(exc),
                "where": "load", "trace": traceback.format_exc(limit=-3)}
    model = loaded.engine.runner.model
    row["path"] = "transformers" if type(model).__module__.startswith(
        "batchrun.models.transformers") else "native"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = loaded.engine.generate(prompts, params)
    except Exception as exc:
        return {**row, "status": "CRASH", "reason": first_line(exc), "where": "generate",
                "trace": traceback.format_exc(limit=-3)}
    firsts, ties, diffs, split = [], 0, [], False
    for out, prompt, (ref, margins) in zip(outs, prompts, refs):
        ours = list(out.outputs[0].token_ids)
        at, tie = compare(ours, ref, margins)
        if at is not None and not tie and (picks := forward_greedy(hf, prompt, ref)) is not None:
            split = True  # generate's tokens are not its forward's: hold ours against those
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
            margins = [float(v) for v in logits.topk(2, dim=-1).values.diff().abs()[:, 0]]
            at, tie = compare(ours, logits.argmax(-1).tolist(), margins)
        ties += tie
        if at is not None and not tie:
            diffs.append(at)
    row["first_differences"] = diffs
    row["ties"] = ties
    row["status"] = "DIFF" if 0 in diffs else "CLOSE" if diffs else "SPLIT" if split else "EXACT"
    return row


def worker(archs: list[str], names: dict) -> None:
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from batchrun.models.weights.resolve import resolve_model

    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY + (4 << 30), resource.RLIM_INFINITY))
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            print(json.dumps({"start": arch}), flush=True)
            started = time.perf_counter()
            try:
                row = census_one(arch, names[arch], tokenizer, Path(tmp))
            except Exception as exc:  # outside what census_one expects
                row = {"arch": arch, "status": "CRASH", "reason": first_line(exc)}
            row["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps({"result": row}), flush=True)


# ----------------------------------------------------------------------------------------------
# The parent: workers over the list, a timeout per architecture.

def arch_names(image_text: bool) -> dict:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    names = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if image_text:
        for k, v in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
            if k not in names or not takes_its_config(k, first(names[k])):
                names[k] = v  # Llama 4: its causal LM takes the text config, not the model's
    return {k: first(v) for k, v in names.items()}


def first(name) -> str:
    return name if isinstance(name, str) else name[0]


def takes_its_config(model_type: str, class_name: str) -> bool:
    """Whether `class_name` is built from `model_type`'s own config class."""
    import transformers
    from transformers import CONFIG_MAPPING

    try:
        return getattr(transformers, class_name).config_class is CONFIG_MAPPING[model_type]
    except Exception:  # a class transformers cannot import here: left to the build to say
        return True


def run_workers(archs: list[str], image_text: bool, timeout: float, jobs: int) -> list[dict]:
    pending = list(archs)
    lock = threading.Lock()
    results: list[dict] = []

    def take(n):
        with lock:
            batch, pending[:] = pending[:n], pending[n:]
            return batch

    def one_worker():
        while True:
            batch = take(8)
            if not batch:
                return
            results.extend(run_batch(batch, image_text, timeout))

    threads = [threading.Thread(target=one_worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r["arch"])


def run_batch(batch: list[str], image_text: bool, timeout: float) -> list[dict]:
    """One worker over `batch`; an architecture past `timeout` (or killing the worker) is a CRASH,
    and the ones after it go to a fresh worker."""
    out: list[dict] = []
    while batch:
        cmd = [sys.executable, __file__, "--worker", ",".join(batch)]
        if image_text:
            cmd.append("--image-text")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        stderr: list[str] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        current, deadline = None, time.time() + timeout + 60  # the first one includes imports
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                proc.kill()
                proc.wait()
                out.append({"arch": current or batch[0], "status": "CRASH",
                            "reason": f"Timeout: no result after {timeout:.0f} s"})
                log(f"{current}: TIMEOUT")
                break
            if line is None:
                proc.wait()
                if current is not None:
                    tail = "".join(stderr[-3:]).strip().splitlines()
                    out.append({"arch": current, "status": "CRASH",
                                "reason": f"worker died (exit {proc.returncode}): "
                                          f"{tail[-1] if tail else ''}"[:300]})
                    log(f"{current}: worker died")
                break
            msg = json.loads(line) if line.startswith("{") else {}
            if "start" in msg:
                current, deadline = msg["start"], time.time() + timeout
            elif "result" in msg:
                row = msg["result"]
                out.append(row)
                log(f"{row['arch']:28s} {row['status']:8s} {row.get('reason', '')[:100]}")
                current = None
        done = {r["arch"] for r in out}
        batch = [a for a in batch if a not in done]
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'architecture':28s} {'status':8s} {'path':12s} detail")
    for r in rows:
        detail = r.get("reason") or (f"first differences at {r['first_differences']}"
                                     if r.get("first_differences") else "")
        print(f"{r['arch']:28s} {r['status']:8s} {r.get('path', ''):12s} {detail[:110]}")
    totals: dict[str, list[str]] = {}
    for r in rows:
        totals.setdefault(r["status"], []).append(r["arch"])
    print("\ntotals: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(totals.items())))
    for status in ("CLOSE", "DIFF", "SPLIT", "REFUSED", "CRASH"):
        if totals.get(status):
            print(f"{status}: {' '.join(totals[status])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--image-text", action="store_true",
                        help="also the image-text-to-text mapping (text prompts only)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per architecture")
    parser.add_argument("--jobs", type=int, default=1, help="workers at once")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = arch_names(args.image_text)
    if args.worker:
        worker(args.worker.split(","), names)
        return
    archs = sorted(names) if not args.only else args.only.split(",")
    unknown = [a for a in archs if a not in names]
    if unknown:
        parser.error(f"not in the mapping: {', '.join(unknown)}")
    rows = run_workers(archs, args.image_text, args.timeout, args.jobs)
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
