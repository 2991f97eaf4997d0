"""What int8 computes on this process's oneDNN ISA path, as one JSON line on stdout (run by
tests/unit/test_int8_isa_paths.py once per ONEDNN_MAX_CPU_ISA cap):

- `exact`: whether onednn_int8_available() took oneDNN's int8 GEMM (False: the float emulation);
- `layers`: digests of smoothed Int8Linear outputs (outlier channels included) at decode and
  prefill row counts;
- `tokens` / `logprobs`: a tiny calibrated int8 Llama's greedy continuations and their logprobs.

The int32 sums are exact on every path, so all three must be the same bits whatever the path."""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch


def layer_digests(kernels) -> list[str]:
    from batchrun.models.quant.int8_linear import Int8Linear, attach_kernels

    gen = torch.Generator().manual_seed(5)
    out = []
    for k, n in ((64, 48), (576, 96), (1544, 40)):
        weight = torch.randn(n, k, generator=gen)
        smooth = torch.rand(k, generator=gen) + 0.5
        layer = Int8Linear(weight, torch.randn(n, generator=gen), smooth=smooth,
                           outliers=torch.tensor([1, 7, k - 1]))
        holder = torch.nn.Sequential(layer)
        attach_kernels(holder, kernels)
        for rows in (1, 7, 67, 300):
            x = torch.randn(rows, k, generator=gen) * 3
            out.append(hashlib.sha256(layer(x).numpy().tobytes()).hexdigest()[:16])
    return out


def tiny_int8_run(tmp: Path) -> tuple[list[list[int]], list[float]]:
    from pytest import MonkeyPatch
    from transformers import AutoConfig

    from batchrun.engine import SamplingParams
    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from batchrun.models.quant import calibration
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import IdTokenizer, calibrate_int8_on_random_tokens, make_tiny

    path = tmp / "llama"
    make_tiny("llama", path)
    with MonkeyPatch.context() as mp:
        # the calibration cached apart; the kernel library from the usual cache (built once)
        mp.setattr(calibration, "cache_path", lambda files, method, dtype: tmp / f"{method}.pt")
        calibrate_int8_on_random_tokens(mp)
        cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        model = build_model(LlamaModel, cfg, path, torch.device("cpu"), torch.float32, "int8")
        engine = build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2],
                              torch.device("cpu"), torch.float32)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 23, 41)]
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = engine.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [lp.top[0][1] for o in outs for lp in o.outputs[0].logprobs]
    return tokens, logprobs


def probe(tmp: Path) -> dict:
    from batchrun.models.quant.int8_linear import onednn_int8_available
    from tests.helpers import kernel_library

    tokens, logprobs = tiny_int8_run(tmp)
    return {"exact": onednn_int8_available(), "layers": layer_digests(kernel_library()),
            "tokens": tokens, "logprobs": logprobs}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(probe(Path(tmp)), sys.stdout)


if __name__ == "__main__":
    main()
