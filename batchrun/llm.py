"""Load a model by name or path and build an engine around it."""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchrun import phases
from batchrun.options.engine import EngineConfig
from batchrun.engine.devices import pick_device, pick_dtype
from batchrun.engine.engine import Engine
from batchrun.engine.kv_sizing import kv_layout
from batchrun.engine.model import TakesImages
from batchrun.models.invariance import (check_batch_invariant, native_module_name,
                                        with_default_invariance)
from batchrun.served_model import system_fingerprint

# Sampling fields a model's generation_config.json may set, mapped to SamplingParams names.
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                             "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                             "max_new_tokens": "max_tokens"}


@dataclass
class LoadedModel:
    """The model and its engine in this process: a batchrun.served_model.ServedModel."""

    engine: Engine
    tokenizer: Any  # models.tokenizer.Tokenizer, or a transformers tokenizer
    name: str  # served model name, e.g. "smollm2-135m"
    aliases: tuple[str, ...]
    # Sampling defaults from the model's generation_config.json, only the fields it sets,
    # under SamplingParams names: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    # The LoRA adapters served on it (--lora NAME=PATH): a request's `model` may name one.
    adapters: tuple[str, ...] = ()
    # A vision-language model's transformers processor (models/transformers/processor.py):
    # renders chat lines with images; None for text-only models.
    processor: Any = None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.engine.eos_token_ids))

    @property
    def hidden_size(self) -> int | None:
        return self.engine.hidden_size

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.name, self.engine.config)


def set_cpu_threads(config: EngineConfig) -> None:
    """torch's intra-op threads for a CPU engine: --threads, else $BATCHRUN_THREADS, else one
    per core."""
    threads = config.device.threads or int(os.environ.get("BATCHRUN_THREADS", 0)) or os.cpu_count()
    torch.set_num_threads(threads or 1)


def load(model: str | None, config: EngineConfig | None = None) -> LoadedModel:
    """Resolve `model` (registry name, HF folder, .gguf, hub id; None = default) and start an engine."""
    from batchrun.models.weights.resolve import resolve_model

    config = config or EngineConfig.default()
    files = resolve_model(model, config.trust_remote_code)
    phases.mark("model files (a .gguf converted once)")
    check_adapters(config.lora, (files.name, *files.aliases))
    return load_from_path(files.path, config, name=files.name, aliases=files.aliases)


def check_adapters(lora, base_names) -> None:
    """LoraError for an adapter named like the base model (a request naming it would run on
    the adapter) or whose adapter_config.json is missing or refused: before the weights load,
    so the mistake costs no load. The weights are checked against the base when it is built."""
    from batchrun.models.lora.adapter import LoraError, read_config

    clash = sorted(set(lora.adapters) & set(base_names))
    if clash:
        raise LoraError(f"--lora {clash[0]}={lora.adapters[clash[0]]}: {clash[0]!r} is the base "
                        f"model's served name or alias; give the adapter another name")
    for name, path in lora.adapters.items():
        read_config(name, path, lora.max_lora_rank)


def load_from_path(path: str | Path, config: EngineConfig | None = None, name: str | None = None,
                   aliases: tuple[str, ...] = ()) -> LoadedModel:
    from batchrun.models.text.tokenizer import load_tokenizer

    config = config or EngineConfig.default()
    path = Path(path)
    device = pick_device(config.device.device)
    dtype = pick_dtype(config.device.dtype, device)
    if device.type == "cpu":
        set_cpu_threads(config)
    config = with_default_invariance(path, config, device, dtype)

    model = load_weights(path, config, device, dtype)
    trusted = config.trust_remote_code
    from batchrun.models.transformers.model import TransformersModel

    # The transformers backend's steps sync on the host: no CUDA graphs (every native layer
    # kind, windows, soft-capping and sinks included, runs in the Triton kernels).
    if isinstance(model, TransformersModel):
        config = config.model_copy(update={"device": config.device.model_copy(
            update={"cuda_graphs": False})})
    tokenizer = load_tokenizer(path, trusted)
    gen_defaults, gen_eos = read_generation_config(path)
    phases.mark("tokenizer and chat template")

    eos = set(gen_eos)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    name = name or path.name
    engine = build_engine(model, tokenizer, config, sorted(eos), device, dtype,
                          base_names=(name, *aliases))
    phases.mark("engine (KV cache)")
    processor = None
    if isinstance(model, TakesImages):
        from batchrun.models.transformers.processor import load_processor, processor_class

        if processor_class(path) is not None:  # without one it runs as a text model
            processor = load_processor(path, trusted)
        else:
            logging.getLogger("batchrun").warning(
                "%s saves no processor: it runs as a text model (image parts refused)", path)
    return LoadedModel(engine, tokenizer, name, tuple(aliases), gen_defaults, path,
                       adapters=tuple(config.lora.adapters), processor=processor)


def load_weights(path: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The model at `path` on the path --model-impl picks (models/transformers/support.py);
    a ValueError says why a model cannot run (a ModelFolderError names the file: a config out
    of range, code the folder ships without --trust-remote-code, damaged weights), before
    anything is allocated."""
    from batchrun.models.arch import native
    from batchrun.models.config.hf_config import read_config
    from batchrun.models.transformers.support import UnsupportedModelError, choose
    from batchrun.models.weights.safetensors_check import check_safetensors

    hf = read_config(path, config.trust_remote_code)
    check_safetensors(sorted(path.glob("*.safetensors")))
    native_path = choose(hf, config.model_impl).impl == "native"
    check_batch_invariant(config, native_path, native_module_name(hf), device)
    if native_path:
        native_model = build_native(hf, path, config, device, dtype)
        if native_model is not None:
            return native_model
    native_types = ", ".join(sorted(native.NATIVE_MODULES))
    from batchrun.models.quant import checkpoint_method, method

    how = method(config.device.quantization)
    how.check_device(device, backend=True)

    stored = checkpoint_method(hf)
    if stored is not None:
        raise UnsupportedModelError(f"the checkpoint is stored quantized ({stored[0]}); "
                                    f"quantized checkpoints load on the native path only ({native_types})")
    from batchrun.models.transformers import model as text, stateful, stateful_vision, vision

    if vision.is_vision_language(hf):
        loader = stateful_vision if stateful.runs(hf) else vision
    else:
        loader = stateful if stateful.runs(hf) else text
    model = loader.load(path, device, dtype, how, config.trust_remote_code)
    phases.mark("weights (transformers backend)")
    return model


def build_native(hf, path: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The native model of `hf`; None where its load check found it differs from transformers
    and --model-impl auto lets the transformers backend run it instead (a path that agrees)."""
    from batchrun.models.arch import native
    from batchrun.models.load_check import LoadCheckError

    module = native.native_module(hf)
    try:
        return build_model(module.Model, module.ModelConfig.from_hf(hf), path, device, dtype,
                           config.device.quantization, config.batch_invariant)
    except LoadCheckError as exc:
        if config.model_impl != "auto" or config.batch_invariant:
            raise
        logging.getLogger("batchrun").warning("%s; running it on the transformers backend", exc)
        return None


def build_engine(model, tokenizer, config: EngineConfig, eos_token_ids, device: torch.device,
                 dtype: torch.dtype, base_names: tuple[str, ...] = ()) -> Engine:
    """The engine over `model`, with the LoRA adapters config.lora names (checked now: a bad
    one is a LoraError, a ValueError)."""
    num_blocks, max_model_len, kv_dtype = kv_layout_for(config, model.config, device, dtype)
    kv_scales = fp8_kv_scales(model) if kv_dtype.is_floating_point and kv_dtype.itemsize == 1 \
        else None
    adapters = None
    if config.lora.adapters:
        from batchrun.models.lora import LoraManager

        lora = config.lora
        adapters = LoraManager(model, lora.adapters, lora.max_loras, lora.max_lora_rank, device,
                               dtype, base_names)
    return Engine(model, tokenizer, config, eos_token_ids, device, dtype, num_blocks, max_model_len,
                  kv_dtype=kv_dtype, adapters=adapters, kv_scales=kv_scales)


def kv_layout_for(config: EngineConfig, model_cfg, device: torch.device, dtype: torch.dtype):
    """engine/kv_sizing.py's kv_layout with --kv-cache-dtype auto as the --quantization method
    means it (the engine cannot import models/); footprint sizes the pool with it too."""
    from batchrun.models.quant import method

    auto = method(config.device.quantization).default_kv_dtype(dtype)
    return kv_layout(config, model_cfg, device, dtype, auto)


def fp8_kv_scales(model) -> torch.Tensor:
    """[layers, 2] K/V scales of an fp8 KV cache, from the calibration text's K/V maxima
    (computed at the first load, cached): engine/attention/fp8_kv.py."""
    from batchrun.engine.attention.fp8_kv import scales_from_absmax
    from batchrun.models.arch.native import FromCheckpoint
    from batchrun.models.quant.calibration import kv_absmax

    checkpoint = model.checkpoint if isinstance(model, FromCheckpoint) else None
    if checkpoint is None:
        raise ValueError("--kv-cache-dtype fp8 needs the native path (its scales come from a "
                         "calibration run through the native model); this model runs on the "
                         "transformers backend")
    path, files = checkpoint
    scales = scales_from_absmax(kv_absmax(model, files, path))
    phases.mark("fp8 KV scales (calibration, cached after the first load)")
    return scales


def build_model(cls, model_cfg, path: Path, device: torch.device, dtype: torch.dtype,
                quantization: str = "none", batch_invariant: bool = False):
    """The model with its weights (memory-mapped safetensors), its linears packed for oneDNN
    (or quantized: models/quant/), with batch_invariant run on fixed-size row slices
    (models/layers/fixed_rows.py), and, on the CPU, its C kernels, which build (once per machine)
    while the weights load."""
    from batchrun.models import quant
    from batchrun.models.arch import native
    from batchrun.models.layers import packed_linear
    from batchrun.models.quant import QuantizationError, check_checkpoint, cpu
    from batchrun.models.quant.precision import Precision
    from batchrun.models.quant.ready import attach_cpu_kernels, ready_linears, uses_float32_logits

    how = quant.method(quantization)
    how.check_device(device)
    try:  # a checkpoint stored quantized: its format
        precision = Precision(how, check_checkpoint(model_cfg.hf_config, device))
    except QuantizationError as exc:
        raise QuantizationError(f"{path / 'config.json'}: {exc}") from None
    slow_bf16 = cpu.slow_bf16_note(dtype, device, how.name if how.bf16_gemms else None)
    if slow_bf16:
        logging.getLogger("batchrun").warning(slow_bf16)
    if precision.stored is not None and batch_invariant:
        raise QuantizationError(f"--batch-invariant does not cover a checkpoint stored quantized "
                                f"({precision.stored.describe()})")
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    from batchrun.engine import kernels as cpu_kernels

    kernels = None
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels.enabled():
        kernels = _kernels_in_background(cpu_kernels.shape_flags(
            model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim))
    # Allocated, not initialised: every parameter is overwritten by the checkpoint. (Building on
    # the meta device instead runs its ops as Python references, whose first call imports
    # torch._dynamo: half a second.)
    with native.no_init(), (contextlib.nullcontext() if device.type == "cpu" else device):
        model = cls(model_cfg)
    # before the dtype cast: the float layers and experts they replace are never touched (a
    # bfloat16 copy of a quantized MoE's float experts doubled its peak memory), and the float
    # parts they keep take the model's dtype
    in_gguf = precision.load_layers(model, path)  # tensors the quantized layers already hold
    model = model.to(dtype)
    if device.type != "cpu" or dtype != torch.float32:  # float32 tables computed on the CPU
        model.rope = type(model.rope)(model_cfg).to(device)
    _load_float_weights(model, [Path(f) for f in files], path, skip=in_gguf)
    gate = None  # int8's load gate (models/quant/gate.py): the float model's choices first
    if precision.calibrated:  # a stored checkpoint's layers: requantized plain
        from batchrun.models.quant.gate import Gate
        from batchrun.models.quant.smoothquant import has_logits_layer, prepare_int8

        if has_logits_layer(model):
            gate = Gate.before(model, [Path(f) for f in files], path)
        prepare_int8(model, [Path(f) for f in files], path)
        phases.mark("weights (load) and int8 calibration (cached after the first load)")
    ready_linears(model, how, pack_float=device.type == "cpu" and packed_linear.available(dtype),
                  float32_logits=uses_float32_logits(kernels is not None, dtype),
                  batch_invariant=batch_invariant)
    phases.mark("weights (load, pack)")
    if kernels is not None:
        attach_cpu_kernels(model, kernels.result(), precision.has_quantized_layers, batch_invariant)
        phases.mark("CPU kernels (built once, beside the weights)")
    if gate is not None:
        gate.judge(model.eval())
        phases.mark("int8 gate (the quantized model against the float one)")
    if not precision.has_quantized_layers:  # quantized: the gate's (int8) and quality's
        from batchrun.models import native_check

        native_check.check(model.eval(), path, [Path(f) for f in files], device, dtype)
        phases.mark("load check (against transformers; its reference cached after the first load)")
    return model.eval()


def _load_float_weights(model, files: list[Path], path: Path, skip: set[str]) -> None:
    """The checkpoint's tensors (but those in `skip`, which quantized layers hold) into the
    model; ModelFolderError naming the file for a non-finite weight or one the config has no
    place for. Records model.checkpoint: what calibrations key their caches by."""
    from safetensors import safe_open

    from batchrun.models.errors import ModelFolderError
    from batchrun.models.weights.safetensors_check import named

    reading: list = [path]  # the file being read: what a weight's error names

    def tensors():
        for f in files:
            reading[0] = f
            with safe_open(f, framework="pt") as sf:
                for key in sf.keys():
                    if key in skip:
                        continue
                    tensor = sf.get_tensor(key)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise ValueError(f"weight {key!r} holds non-finite values (NaN or inf): "
                                         "the checkpoint is damaged")
                    yield key, tensor
        reading[0] = named([str(f) for f in files], path)

    try:
        model.load_weights(tensors())
    except (ValueError, KeyError, IndexError) as exc:  # a weight the config has no place for
        detail = exc if isinstance(exc, ValueError) else \
            f"a weight has no place in the model its config describes ({exc!r})"
        raise ModelFolderError(f"{reading[0]}: {detail}") from exc
    model.checkpoint = (path, files)


@functools.lru_cache(maxsize=None)
def _kernels_in_background(flags: tuple[str, ...]):
    """The future of the CPU kernel library for `flags` (one per process): its first build (a
    C compiler run of about two seconds, outside the GIL) overlaps loading the weights."""
    from concurrent.futures import ThreadPoolExecutor

    from batchrun.engine import kernels

    pool = ThreadPoolExecutor(1, thread_name_prefix="batchrun-kernels")
    future = pool.submit(kernels.library, flags)
    pool.shutdown(wait=False)
    return future


def read_generation_config(path: Path) -> tuple[dict[str, Any], list[int]]:
    """(sampling defaults the model sets, its extra EOS ids) from generation_config.json;
    ModelFolderError for a file that is not a JSON object or EOS ids that are not token ids."""
    from batchrun.models.errors import ModelFolderError
    from batchrun.models.weights.json_file import read_object

    f = path / "generation_config.json"
    if not f.exists():
        return {}, []
    raw = read_object(f)
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULT_FIELDS.items()
                if raw.get(theirs) is not None}
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise ModelFolderError(f"{f}: eos_token_id {eos!r} is not a token id or a list of them")
    return defaults, eos_ids
