"""Reduced-precision linear layers, chosen by the `quantization` option at load.

- int8: W8A8. Weights int8 per output channel (symmetric), activations int8 per token, scaled
  at run time; oneDNN's int8 GEMM (AMX-INT8 / AVX512-VNNI / AVX2) accumulates in int32.
- int8-weight: int8 weights per output channel, float activations.
- int4-weight: int4 weights in groups of 32 along the input with a scale and a zero each (the
  layout of GGUF's Q4_1), float activations.
- gguf: a GGUF checkpoint's projections in their own block formats, exactly (quant/gguf.py:
  Q4_0/Q4_1/Q4_K as int4-weight's groups, Q8_0/Q5_K/Q6_K as grouped int8); every other
  linear stays float.
- fp8: float8 e4m3 weights per output channel and float8 activations per token (dynamic),
  scaled GEMMs (fp8_linear.Fp8Linear; emulated with the same values on the CPU).
- bf16: bfloat16 weights and GEMMs (AMX / AVX512-BF16) in a float32 model: unlike
  --dtype bfloat16, the residual stream, norms, attention and KV cache stay float32.

The logits layer (lm_head, or the tied embeddings' packed copy) stays in the model's dtype,
except under int8: calibrated (a float checkpoint) it is a smoothed int8 layer with float outlier
channels (smoothquant.py LOGITS); uncalibrated (a stored checkpoint requantized) on a CPU with
fast bfloat16 it is a bfloat16 GEMM (Method.logits_in_bf16). benchmarks/quality.py measured plain int8
logits at +0.85% perplexity for int8, and bfloat16 logits at 98.6% top-1 instead of 99.7% for
bf16. Each method is one object (methods.py: what loading, footprint and KV sizing ask of it);
On CUDA, int8, int8-weight, int4-weight and fp8 (and GPTQ / AWQ / compressed-tensors / FP8
checkpoints) run through Triton GEMMs (on_device.py); gguf, bf16, MXFP4 and GGUF sources are
refused there. `quantize_linears` is the one place a model's nn.Linear layers become quantized modules
(replace_linears calls it).
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.methods import METHODS, LinearClass, Method, method

__all__ = ["METHODS", "LinearClass", "Method", "method", "QuantizationError"]

# precision-critical: the logits (a classifier's head), and MoE routers (a rounding there switches a
# token's experts; the experts themselves are 3-D tensors, not linears, and stay float); a linear
# named so, or inside a module named so (a transformers model's router.layer)
KEEP_FLOAT = ("lm_head", "score", "gate", "shared_expert_gate", "router")


def kept_float(name: str, keep: tuple[str, ...] = KEEP_FLOAT) -> bool:
    """Whether the linear at qualified `name` stays float under --quantization."""
    return any(part in keep for part in name.split("."))


# A checkpoint stored quantized, read in its own format: quant_method -> the module that reads it
# (check, describe, nbytes, read; read_fused and HOLDS where it quantizes fused experts only:
# models/quant/checkpoint.py loads through it).
CHECKPOINT_FORMATS = {"gptq": "batchrun.models.quant.gptq", "awq": "batchrun.models.quant.awq",
                      "compressed-tensors": "batchrun.models.quant.compressed_tensors",
                      "fp8": "batchrun.models.quant.fp8", "mxfp4": "batchrun.models.quant.mxfp4"}
# the formats whose layers run on CUDA (Triton: int4 GEMM for GPTQ / AWQ / compressed-tensors
# W4A16, the W8A8 and weight-only GEMMs for int8 and FP8 weights)
CUDA_FORMATS = ("gptq", "awq", "compressed-tensors", "fp8")


class CheckpointFormat:
    """A quantized checkpoint's method and config, with the module that reads it."""

    def __init__(self, method: str, config: dict):
        import importlib

        self.method, self.config = method, config
        self.module = importlib.import_module(CHECKPOINT_FORMATS[method])

    def describe(self) -> str:
        return self.module.describe(self.config)

    @property
    def holds(self) -> str:
        """What the format stores quantized: "linears" (and routed experts), or "routed experts"."""
        return getattr(self.module, "HOLDS", "linears")

    def nbytes(self, out_features: int, in_features: int) -> int:
        return self.module.nbytes(self.config, out_features, in_features)

    def load_linears(self, model: nn.Module, folder, how: Method = METHODS["none"]) -> set[str]:
        """The stored layers in place of the model's linears, as stored, or with a
        --quantization method `how` dequantised one layer at a time and quantized by it (not
        exact)."""
        from batchrun.models.quant import checkpoint

        from batchrun.models.quant.decoder import as_stored

        make = how.linear_class() if how.quantizes else None

        def requantize(layer: nn.Module) -> nn.Module:
            assert make is not None
            stored = as_stored(layer)
            return make(stored.dequantized_weight().float(), stored.bias)

        return checkpoint.load_linears(
            model, folder, lambda t, p: self.module.read(t, p, self.config), self.method,
            None if make is None else requantize, getattr(self.module, "read_fused", None))


def checkpoint_method(hf_config) -> tuple[str, dict] | None:
    """(quant_method, its config as a dict) of a checkpoint stored quantized; None for a float one."""
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    method = config.get("quant_method")
    return str(getattr(method, "value", method) or "unknown"), config


def check_checkpoint(hf_config, device: torch.device | None = None) -> CheckpointFormat | None:
    """The format of a checkpoint stored quantized (None for a float one); a QuantizationError
    naming the method and why where batchrun cannot run it (a format it does not read, a
    variant of one it does, or a device it has no kernels for)."""
    found = checkpoint_method(hf_config)
    if found is None:
        return None
    method, config = found
    if method not in CHECKPOINT_FORMATS:
        raise QuantizationError(
            f"the checkpoint is quantized with {method!r}, which batchrun does not load (it reads "
            f"{', '.join(CHECKPOINT_FORMATS)} checkpoints quantized); use its float checkpoint "
            "with --quantization int8 / int8-weight / int4-weight / bf16, or a GGUF file with "
            "--quantization gguf (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and Q8_0 load as they are)")
    fmt = CheckpointFormat(method, config)
    _check_values(fmt)
    if device is not None and device.type != "cpu" and not (
            device.type == "cuda" and method in CUDA_FORMATS):
        raise QuantizationError(f"the {method} checkpoint's quantized layers run on the CPU only "
                                f"(batchrun has no {device.type} kernels for them; CUDA runs "
                                f"{', '.join(CUDA_FORMATS)} checkpoints); use --device cpu")
    return fmt


# quantization_config keys the formats compute with: (smallest, largest) whole number; a group
# size may also be -1 (one group per row).
_WHOLE_NUMBERS = {"bits": (1, 16), "w_bit": (1, 16), "num_bits": (1, 16),
                  "group_size": (1, 1 << 20), "q_group_size": (1, 1 << 20)}


def _check_values(fmt: CheckpointFormat) -> None:
    """QuantizationError for a quantization_config the format cannot compute with: a bit width
    or group size that is not a whole number in range (at its top level or in a
    compressed-tensors scheme's weights), or any other value its check, describe or byte count
    trips on."""
    config = fmt.config
    schemes = config.get("config_groups")
    parts = [config] + ([s.get("weights") for s in schemes.values() if isinstance(s, dict)]
                        if isinstance(schemes, dict) else [])
    for part in parts:
        for key, (low, high) in _WHOLE_NUMBERS.items():
            value = part.get(key) if isinstance(part, dict) else None
            if value is None or (key.endswith("group_size") and value == -1):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise QuantizationError(f"quantization_config {key} {value!r}: a whole number "
                                        f"from {low} to {high:,} is needed")
    try:
        fmt.module.check(config)
        fmt.describe()
        fmt.nbytes(256, 256)
    except QuantizationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a value of a type or range the format does not take
        raise QuantizationError(f"quantization_config of method {fmt.method!r} holds a value "
                                f"batchrun cannot use ({type(exc).__name__}: {exc})") from None


@torch.no_grad()
def quantize_linears(model: nn.Module, how: Method, keep: tuple[str, ...] = KEEP_FLOAT,
                     float_linear=None) -> int:
    """Replace every nn.Linear of `model` not named in `keep` by `how`'s module (those in
    `keep` by float_linear(weight, bias) when given); returns how many were quantized. Under
    `gguf` the quantized layers are in place already (quant/gguf.py): the rest stay float."""
    make = how.linear_class() if how.linear else None
    # the logits layer only (on the CPU): routers and a classifier's head stay in the model's dtype
    bf16_logits = METHODS["bf16"].linear_class() if how.logits_in_bf16() else float_linear
    count = 0
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if kept_float(f"{path}.{child_name}", keep) or make is None:
                on_cpu = child.weight.device.type == "cpu"
                kept = bf16_logits if child_name == "lm_head" and on_cpu else float_linear
                if kept is not None:
                    setattr(module, child_name, kept(child.weight, child.bias))
                continue
            setattr(module, child_name, make(child.weight.float(), child.bias))
            count += 1
    return count


def replace_linears(model: nn.Module, how: Method, pack_float: bool) -> int:
    """The model's linears for `how`: quantized modules (the kept-float ones packed when
    pack_float), or with no method packed float linears (pack_float) or left as they are."""
    from batchrun.models.layers.packed_linear import PackedLinear, pack_linears

    if not how.quantizes:
        return pack_linears(model) if pack_float else 0
    return quantize_linears(model, how, float_linear=PackedLinear if pack_float else None)
