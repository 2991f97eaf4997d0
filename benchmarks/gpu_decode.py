"""GPU throughput check on a random-weight model shaped like SmolLM2-135M (weights do not change
speed; fixed output lengths via ignore_eos). Compares, in one run: batchrun with CUDA graphs,
batchrun eager, and transformers generate on static batches of 32.

    python benchmarks/gpu_decode.py [--requests 256] [--prompt 200] [--out 128]
"""

import argparse
import tempfile
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--out", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()

    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from batchrun.options.engine import EngineConfig
    from batchrun.engine import SamplingParams
    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from tests.tiny_models import IdTokenizer

    from pathlib import Path

    path = Path(tempfile.mkdtemp())
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 49000, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)
    dev = torch.device("cuda")
    mcfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    total = args.requests * args.out
    results = {}
    for graphs in (True, False):
        model = build_model(LlamaModel, mcfg, path, dev, torch.bfloat16)
        t0 = time.perf_counter()
        engine = build_engine(model, IdTokenizer(), EngineConfig.default(
            device="cuda", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=4096, cuda_graphs=graphs, kv_cache_memory=8 << 30), [2], dev, torch.bfloat16)
        setup = time.perf_counter() - t0
        engine.generate(prompts[:4], params)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        results["batchrun graphs" if graphs else "batchrun eager"] = total / dt
        print(f"batchrun cuda_graphs={graphs}: {total / dt:.0f} out tok/s ({dt:.1f}s, setup {setup:.1f}s)")
        del engine, model
        torch.cuda.empty_cache()
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    t0 = time.perf_counter()
    for i in range(0, args.requests, 32):
        ids = torch.tensor(prompts[i:i + 32], device=dev)
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.out, min_new_tokens=args.out,
                    do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    results["hf static 32"] = total / dt
    print(f"hf generate static 32: {total / dt:.0f} out tok/s ({dt:.1f}s)")
    base = results["hf static 32"]
    for k, v in results.items():
        print(f"{k:<18} {v:>8.0f} tok/s  x{v / base:.2f}")


if __name__ == "__main__":
    main()
