"""Prefix caching for a model with recurrent state (engine/state_checkpoints.py): few-shot
prompts sharing a long prefix through a small random Mamba-2 hybrid (Bamba's layers: Mamba-2
mixers and one attention layer in four) on the transformers backend, or (--model qwen3_next) a
small random Qwen3-Next on the native path (Gated DeltaNet layers, whose checkpoints are
written in pieces: engine/state_checkpoint_pieces.py), with the prefix cache off and on at
several checkpoint intervals. Reports wall time, output tok/s, prompt tokens computed and
served from the cache, and checks every run's greedy tokens equal the cache-off run's.

    python benchmarks/hybrid_prefix.py [--model bamba|qwen3_next] [--prompts 16]
                                       [--prefix 768] [--tail 32] [--intervals 16,64,256]
                                       [--threads 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchrun.engine import SamplingParams  # noqa: E402
from batchrun.llm import build_engine, load_weights  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from tests.tiny_models import (NATIVE_STATE_ARCHS, STATE_ARCHS, IdTokenizer,  # noqa: E402
                               make_tiny)

BS = 16
# A small hybrid: 8 layers of width 256 (Mamba-2 mixers of 8 heads of 64, one attention layer
# in four), chunked scan over 64 positions.
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             attn_layer_indices=[3, 7], mamba_n_heads=8, mamba_d_head=64, mamba_chunk_size=64,
             max_position_embeddings=4096)
# A small Qwen3-Next: 8 layers of width 256, every fourth full attention, Gated DeltaNets of
# 4 value heads of 64 (2 key heads), MoE of 8 experts (2 a token) beside a shared expert.
SMALL_QWEN3_NEXT = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, layer_types=(["linear_attention"] * 3
                                                     + ["full_attention"]) * 2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=256, mlp_only_layers=[], max_position_embeddings=4096)
MODELS = {"bamba": ("bamba", STATE_ARCHS, SMALL, "transformers"),
          "qwen3_next": ("qwen3_next", NATIVE_STATE_ARCHS, SMALL_QWEN3_NEXT, "native")}


def prompts(n: int, prefix: int, tail: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 512, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(3, 512, (tail,), generator=gen).tolist() for _ in range(n)]


def best(path: Path, batch: list[list[int]], max_tokens: int, interval: int | None,
         repeat: int, impl: str) -> dict:
    """The fastest of `repeat` runs, each on a fresh engine (this machine is shared)."""
    return min((run(path, batch, max_tokens, interval, impl) for _ in range(repeat)),
               key=lambda r: r["seconds"])


def run(path: Path, batch: list[list[int]], max_tokens: int, interval: int | None,
        impl: str) -> dict:
    """One engine (interval None: prefix cache off) over the batch."""
    config = EngineConfig.default(model_impl=impl, block_size=BS,
                                  max_num_batched_tokens=2048,
                                  enable_prefix_caching=interval is not None,
                                  state_checkpoint_tokens=interval or BS)
    model = load_weights(path, config, torch.device("cpu"), torch.float32)
    engine = build_engine(model, IdTokenizer(), config, [2], torch.device("cpu"), torch.float32)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up on a prompt sharing nothing with the batch (the timed run starts cold)
    engine.generate([[5] * 40], SamplingParams(temperature=0, max_tokens=2))
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    seconds = time.perf_counter() - start
    cached = sum(o.num_cached_tokens for o in outs)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "seconds": seconds,
            "out_tps": len(batch) * max_tokens / seconds, "cached": cached,
            "computed": sum(map(len, batch)) - cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="bamba")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--intervals", default="16,64,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch = prompts(args.prompts, args.prefix, args.tail)
    arch, archs, shape, impl = MODELS[args.model]
    print(f"# {args.model} ({impl}); {platform.processor() or platform.machine()}, "
          f"{args.threads} threads; "
          f"{args.prompts} prompts of {args.prefix} shared + {args.tail} own tokens, "
          f"{args.max_tokens} generated each")
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny(arch, Path(tmp), archs=archs, **shape)
        off = best(Path(tmp), batch, args.max_tokens, None, args.repeat, impl)
        print("| prefix cache | wall s | output tok/s | prompt tokens computed | from cache | "
              "same tokens |\n|---|---|---|---|---|---|")
        print(f"| off | {off['seconds']:.2f} | {off['out_tps']:.1f} | {off['computed']} | 0 | - |")
        for interval in map(int, args.intervals.split(",")):
            on = best(Path(tmp), batch, args.max_tokens, interval, args.repeat, impl)
            print(f"| on, checkpoint every {interval} | {on['seconds']:.2f} | "
                  f"{on['out_tps']:.1f} | {on['computed']} | {on['cached']} | "
                  f"{on['tokens'] == off['tokens']} |")


if __name__ == "__main__":
    main()
