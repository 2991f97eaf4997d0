"""KV blocks a sliding-window model holds, with the window groups handing back what their layers
can no longer see (engine/kv_groups.py) and without (every layer keeps every block), and how
many sequences of a given length a KV budget fits either way.

    python benchmarks/windowed_kv.py [--prompt 4096] [--window 512] [--budget-mib 1024]

Part 1 runs a tiny random Gemma 3 (6 layers: 5 windowed, 1 full, as Gemma 3's pattern) on the
transformers backend over one long prompt, both ways, and checks both give the same greedy
tokens. Part 2 is arithmetic only (no weights): the blocks per sequence and the sequences a
budget fits, for the tiny model and for Gemma 3 1B's shape (26 layers, 1 in 6 full, window 512,
1 KV head of 256).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchrun.engine import SamplingParams  # noqa: E402
from batchrun.engine.kv_groups import KVGroups, kv_block_bytes  # noqa: E402
from batchrun.llm import build_engine, load_weights  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, make_tiny  # noqa: E402

BS = 16


def run(path: Path, prompt: list[int], chunk: int, windows: bool) -> tuple:
    """(greedy tokens, peak blocks in use, bytes of a block) of one engine."""
    config = EngineConfig.default(model_impl="transformers", block_size=BS,
                                  max_num_batched_tokens=chunk, num_blocks=4096)
    model = load_weights(path, config, torch.device("cpu"), torch.float32)
    if not windows:  # every layer as if it attended the whole context: one group of all
        model.config = dataclasses.replace(model.config, layer_windows=())
    engine = build_engine(model, IdTokenizer(), config, [2], torch.device("cpu"), torch.float32)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return out[0].outputs[0].token_ids, engine.kv.peak_used, kv_block_bytes(model.config, BS, 4)


@dataclasses.dataclass
class Shape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple = ()


def fits(shape: Shape, length: int, budget: int, chunk: int, elem: int) -> tuple[int, int, int]:
    """(blocks per sequence, blocks in the budget, sequences that fit)."""
    groups = KVGroups.of(list(shape.layer_windows or (None,) * shape.num_layers))
    per_seq = groups.blocks_per_sequence(length, BS, chunk)
    blocks = budget // kv_block_bytes(shape, BS, elem)
    return per_seq, blocks, blocks // per_seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--budget-mib", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    types = ["sliding_attention"] * 5 + ["full_attention"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_tiny("gemma3_text", path, archs=BACKEND_ARCHS, num_hidden_layers=6,
                  layer_types=types, sliding_window=args.window,
                  max_position_embeddings=args.prompt + 64)
        prompt = torch.randint(3, 512, (args.prompt,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        with_free = run(path, prompt, args.chunk, True)
        without = run(path, prompt, args.chunk, False)
    assert with_free[0] == without[0], "the two runs' greedy tokens differ"
    print(f"tiny Gemma 3 (6 layers, 5 windowed at {args.window}, 1 full), one prompt of "
          f"{args.prompt} tokens + 8 generated, chunks of {args.chunk}, block size {BS}:")
    for name, (_, peak, block_bytes) in (("window blocks handed back", with_free),
                                         ("every block kept", without)):
        print(f"  {name:26s} peak {peak:5d} blocks x {block_bytes:6d} B = "
              f"{peak * block_bytes / 2 ** 20:7.2f} MiB of KV")
    ratio = (without[1] * without[2]) / (with_free[1] * with_free[2])
    print(f"  KV held: {ratio:.2f}x less with the window groups; same greedy tokens")

    budget = args.budget_mib * 2 ** 20
    tiny = Shape(6, 2, 32, tuple([args.window] * 5 + [None]))
    gemma3_1b = Shape(26, 1, 256, tuple(None if i % 6 == 5 else 512 for i in range(26)))
    for name, shape, length, elem in (("tiny Gemma 3", tiny, args.prompt, 4),
                                      ("Gemma 3 1B (bf16)", gemma3_1b, 32768, 2)):
        print(f"{name}: sequences of {length} tokens in a {args.budget_mib} MiB KV budget "
              f"(chunks of {args.chunk}):")
        for label, s in (("window groups", shape),
                         ("every block kept", dataclasses.replace(shape, layer_windows=()))):
            per_seq, blocks, n = fits(s, length, budget, args.chunk, elem)
            print(f"  {label:18s} {per_seq:6d} blocks a sequence, {blocks:7d} blocks: "
                  f"{n} sequences")


if __name__ == "__main__":
    main()
