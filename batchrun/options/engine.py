"""The engine's configuration: one model per concern. Fields with a public name are options of
`run`, `serve`, `plan` and job specs' [engine] table; the others (cli=False) are for code and
tests."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ByteSize, ConfigDict

from batchrun.options.fields import OptionsError, option, public_fields, validate
from batchrun.options.lora import LoraConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8"]
_STRICT = ConfigDict(extra="forbid", strict=True)


class CacheConfig(BaseModel):
    model_config = _STRICT
    SECTION: ClassVar[str] = "engine"

    block_size: int = option(16, "Tokens per KV block.", cli=False, ge=1)
    kv_cache_memory: ByteSize | None = option(
        None, "KV cache size, e.g. 2GiB [default: 30% of free memory up to 4GiB; 80% on a GPU].")
    num_blocks: int | None = option(
        None, "Explicit KV block count (tests force preemption with it); overrides "
        "kv_cache_memory.", cli=False, ge=1)
    enable_prefix_caching: bool = option(True, "Reuse the KV of prompt prefixes already "
                                         "computed.", name="prefix_cache")
    state_checkpoint_tokens: int = option(
        64, "Tokens between the state checkpoints a model with recurrent state keeps for prefix "
        "caching (rounded down to whole KV blocks): a prefix hit resumes at the last one.",
        cli=False, ge=1)
    kv_cache_dtype: KvDtype = option(
        "auto", "KV cache element type (auto: the model's; bfloat16 under int8). 16-bit halves the "
        "memory decode attention reads, and changes outputs slightly (under --quantization int8 "
        "the same measured quality, half the bytes); fp8 (= fp8_e4m3, CPU, native models) stores "
        "float8 e4m3 with a K and a V scale per layer from a calibration run at load (cached): a "
        "quarter of float32's bytes; int8 (CPU): int8 with a float32 scale per token and KV head. "
        "benchmarks/quality.py measures each.", section="precision")


class SchedulerConfig(BaseModel):
    model_config = _STRICT
    SECTION: ClassVar[str] = "engine"

    # Measured on 2 CPU cores, full humaneval_chat: 256/2048 gave 141 output tok/s against 126
    # for 64/512 (bigger steps amortise streaming the weights from memory every step).
    max_num_seqs: int = option(256, "Most sequences per step.", ge=1)
    max_num_batched_tokens: int = option(2048, "Token budget per step.", name="max_batched_tokens",
                                         ge=1)
    group_by_prefix: bool = option(
        True, "Admit waiting requests in prompt order so shared prefixes run together (batch "
        "mode); False keeps arrival order (interactive serving).", cli=False)


class DeviceConfig(BaseModel):
    model_config = _STRICT
    SECTION: ClassVar[str] = "precision"

    device: str = option("auto", "auto | cpu | cuda | cuda:N.", cli=False)
    dtype: Dtype = option("auto", "Weights and activations; auto = float32 on CPU, bfloat16 on "
                          "CUDA.")
    quantization: Literal["none", "int8", "int8-weight", "int4-weight", "fp8", "gguf", "bf16"] = option(
        "none", "Run the linear layers at reduced precision, quantized at load. The logits "
        "layer stays in --dtype, except int8's. int8: int8 weights per output channel and int8 "
        "activations per token (int8 GEMMs, calibrated at load, the logits layer too); int8-weight "
        "/ int4-weight: weights only (int4 in groups of 32; a GGUF's Q4_0/Q4_1/Q4_K blocks as "
        "they are), float activations; fp8: float8 e4m3 weights per channel and activations per "
        "token (scaled GEMMs; emulated on the CPU); gguf: a GGUF's projections in their own formats, exactly "
        "(Q4_0/Q4_1/Q4_K as int4, Q8_0/Q5_K/Q6_K as grouped int8; other block types refused); "
        "bf16: bfloat16 GEMMs in a float32 model. On CUDA: int8, int8-weight, int4-weight and fp8 "
        "(Triton kernels). benchmarks/quality.py measures each against float32.")
    threads: int | None = option(None, "CPU threads [default: all cores].", ge=1,
                                 section="engine")
    cuda_graphs: bool = option(True, "Capture decode steps in CUDA graphs (CUDA only).",
                               cli=False)
    attention_kernel: Literal["cascade", "legacy"] = option(
        "cascade", "CPU attention path; cascade reads a shared prefix once per step. cascade: "
        "decoding sequences that share prefix KV blocks read them once per step as a group, and "
        "prefill chunks over a cached context read the paged cache in place; legacy: each sequence "
        "reads its whole context, prefill chunks run SDPA over a gathered copy (the earlier path, "
        "kept for comparison).", section="engine")


class EngineConfig(BaseModel):
    model_config = _STRICT
    SECTION: ClassVar[str] = "engine"

    cache: CacheConfig = option(CacheConfig, "")
    scheduler: SchedulerConfig = option(SchedulerConfig, "")
    device: DeviceConfig = option(DeviceConfig, "")
    lora: LoraConfig = option(LoraConfig, "")
    max_model_len: int | None = option(None, "Context length [default: the model's].", ge=2)
    model_impl: Literal["auto", "native", "transformers"] = option(
        "auto", "The model code: native, transformers or auto (native where it can). native: "
        "batchrun's own (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, StableLM, the MoE families, "
        "GPT-OSS); "
        "transformers: transformers' modelling code on batchrun's engine (any decoder-only "
        "attention model); auto: native where it runs the model, else transformers.",
        section="model")
    trust_remote_code: bool = option(
        False, "Run the Python code a model folder ships, with your permissions: read it first. "
        "The auto_map of its config.json or tokenizer_config.json names it. Without this flag such "
        "a folder is refused (exit 2); batchrun never asks on stdin.", section="model")
    batch_invariant: bool = option(
        False, "Make each request's tokens and logprobs independent of the batch it runs in. "
        "Independent of what else is in the batch, its place in it, prefix-cache hits, chunked "
        "prefill, Ray replicas or a resume (CPU, native models; same machine and --threads). Costs "
        "throughput: see the batch invariance guide.")

    @classmethod
    def default(cls, **overrides: Any) -> "EngineConfig":
        """Defaults with some fields set by attribute name or public name, e.g.
        `EngineConfig.default(num_blocks=64, max_num_seqs=8)`."""
        by_attr = {f.path[-1]: f.name for f in public_fields(cls)}
        flat = {by_attr.get(k, k): v for k, v in overrides.items()}
        try:
            return validate(cls, flat)
        except OptionsError as exc:
            raise TypeError(f"engine options: {exc}") from None
