"""What a model costs in memory before it is loaded: its config, weight bytes and KV pool.

    cfg = model_config_for("smollm2-135m")          # reads config.json / GGUF metadata only
    weights_bytes(cfg, "float32")                   # bytes the loaded weights will hold
    kv_reservation(EngineConfig.default(), cfg)     # (KV blocks, bytes) the engine will reserve

Nothing here reads or dequantises weights. The bundled registry models are GGUF files (Q4_1)
that the loader dequantises once to float32 safetensors; the engine then holds them in the run
dtype (float32 on the CPU by default), so their size follows the parameter count and that
dtype, not the size of the GGUF file.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import torch

from batchrun.options.engine import EngineConfig
from batchrun.models.arch.llama import ModelConfig
from batchrun.models.transformers.support import UnsupportedModelError
from batchrun.served_model import TokenizerModel


def parameter_count(cfg) -> int:
    """Parameters of the checkpoint as the model holds them; tied embeddings once. The native
    Llama's by formula; any other (native MoE, the transformers backend) counted on
    transformers' model built on the meta device (models/transformers/check.py)."""
    if type(cfg) is not ModelConfig:
        return _meta_counts(cfg.hf_config)[0]
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = (h * (q + 2 * kv) + (q + 2 * kv if cfg.qkv_bias else 0)  # qkv_proj
             + q * h  # o_proj
             + 3 * h * cfg.intermediate_size  # gate_up_proj, down_proj
             + 2 * h  # input and post-attention RMSNorm
             + (2 * cfg.head_dim if cfg.qk_norm else 0))
    embed = cfg.vocab_size * h
    return embed + cfg.num_layers * layer + h + (0 if cfg.tie_word_embeddings else embed)


# a config's JSON -> _meta_counts
_COUNTS: dict[str, tuple[int, int, dict[tuple[int, int], int], dict[tuple[int, int], int]]] = {}


def _routed_expert_shapes(cfg) -> dict[tuple[int, int], int]:
    """check.routed_expert_shapes of a native model's config (none for a dense Llama)."""
    return {} if type(cfg) is ModelConfig else _meta_counts(cfg.hf_config)[2]


def _meta_counts(hf) -> tuple[int, int, dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(parameters, of them the routed experts', the routed experts' shapes, the shapes of the
    decoder linears the transformers backend quantizes) of transformers' model for `hf`, built
    on the meta device once per config (a plan asks several times)."""
    from batchrun.models.transformers import check
    from batchrun.models.transformers.support import as_transformers_config

    full = as_transformers_config(hf)
    key = full.to_json_string(use_diff=False)
    if key not in _COUNTS:
        model = check.meta_model(full)
        if model is None:
            raise UnsupportedModelError(f"transformers cannot build {full.model_type} from its "
                                        "config, so its parameters cannot be counted")
        params = check.count_parameters(model)
        assert params is not None  # a model was built
        _COUNTS[key] = (params, check.routed_expert_parameters(model, full),
                        check.routed_expert_shapes(model, full), check.decoder_linear_shapes(model))
    return _COUNTS[key]


@dataclasses.dataclass(frozen=True)
class Compute:
    """What one token costs in weights and FLOPs (a multiply-add is 2 FLOPs)."""
    parameters: int
    active_parameters: int  # those a token passes through: top-k routed experts, not all
    experts: int  # routed experts (0: a dense model)
    experts_per_token: int
    layer_flops: int  # per token through the decoder's weights: 2 x their active parameters
    logits_flops: int  # per sampled token: 2 x vocab x hidden
    attention_flops: int  # per (query, key) pair over all layers: QK^T and PV, 4 x heads x head_dim

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compute(cfg) -> Compute:
    """Parameters, active parameters and FLOPs per token of `cfg`'s model. A routed expert
    counts top_k / experts of its weights (the router, a shared expert and attention whole);
    embeddings are a lookup, the logits layer runs for sampled tokens only."""
    from batchrun.models.transformers.config_features import expert_counts

    total = parameter_count(cfg)
    experts, top_k = expert_counts(cfg.hf_config)
    routed = _meta_counts(cfg.hf_config)[1] if experts else 0
    active = total - routed + routed * top_k // max(experts, 1)
    head = cfg.vocab_size * cfg.hidden_size
    body = active - head * (1 if cfg.tie_word_embeddings else 2)
    return Compute(total, active, experts, top_k, 2 * body, 2 * head,
                   4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)


def _packs_tied_logits(cfg, dev: torch.device, dt: torch.dtype) -> bool:
    """Whether the loaded model holds a second, packed copy of tied embeddings for its logits
    (on the CPU, where the loader packs every linear layer for oneDNN)."""
    if not cfg.tie_word_embeddings or dev.type != "cpu":
        return False
    from batchrun.models.layers import packed_linear

    return packed_linear.available(dt)


def tied_logits_copy_bytes(cfg, dtype: torch.dtype | str | None = None,
                           device: torch.device | str = "cpu") -> int:
    """Of weights_bytes unquantized, the logits layer's packed copy of tied embeddings: the
    checkpoint and the parameter count hold that tensor once, the run twice (0 when the
    embeddings are untied, nothing is packed, or a vision-language model is held as built)."""
    dev = device_of(device)
    dt = dtype_of(dtype, dev)
    if vision_language_parameters(cfg) is not None or not _packs_tied_logits(cfg, dev, dt):
        return 0
    return cfg.vocab_size * cfg.hidden_size * dt.itemsize


def device_of(device) -> torch.device:
    from batchrun.engine.devices import pick_device

    return device if isinstance(device, torch.device) else pick_device(str(device or "auto"))


def dtype_of(dtype, device: torch.device) -> torch.dtype:
    from batchrun.engine.devices import pick_dtype

    return dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype or "auto", device)


def weights_bytes(cfg, dtype: torch.dtype | str | None = None,
                  device: torch.device | str = "cpu", quantization: str = "none",
                  gguf: Path | None = None) -> int:
    """Bytes the loaded model's weights hold: parameter count x element size of `dtype`
    ("auto"/None = the engine's default for `device`: float32 on the CPU), with the decoder
    layers' linears at `quantization`'s size (models/quant/: int8 or int4 and their scales;
    MoE routers and the routed experts' 3-D weights stay float, as quantize_linears keeps them);
    under `gguf`, the projections of the `gguf` file in their own formats (quant/gguf.py);
    for a checkpoint stored quantized (GPTQ, AWQ, compressed-tensors, FP8), at its format's,
    routed experts included.

    Tied embeddings are one tensor in the checkpoint, but on the CPU, where the loader packs
    every linear layer for oneDNN (models/layers/packed_linear.py; the transformers backend's too),
    the logits get a packed copy of them: counted, since it is memory the run holds. The RoPE
    cos/sin tables (computed, not loaded) are not weights and not counted.
    """
    from batchrun.models.quant.precision import Precision

    dev = device_of(device)
    dt = dtype_of(dtype, dev)
    whole = vision_language_parameters(cfg)
    precision = Precision.of(cfg.hf_config, quantization)  # a stored checkpoint: its layers' sizes
    how = precision.method
    if not is_native(cfg) and not how.on_backend:
        raise UnsupportedModelError(f"--quantization {how.name} needs the native path; this "
                                    "model runs on the transformers backend")
    if whole is not None and not how.quantizes:  # held as built, in the run dtype
        return whole * dt.itemsize
    if precision.stored is not None and not is_native(cfg) and whole is None:
        raise UnsupportedModelError(f"the checkpoint is stored quantized ({precision.stored.method}), "
                                    "which loads on the native path only")
    if whole is not None or (how.quantizes and not is_native(cfg)):
        return _backend_bytes(cfg, whole, dt, precision)
    count = parameter_count(cfg)
    if _packs_tied_logits(cfg, dev, dt):
        count += cfg.vocab_size * cfg.hidden_size
    if how.needs_gguf and gguf is not None:
        from batchrun.models.quant.gguf import kept_bytes

        weights, kept = kept_bytes(gguf)
        return (count - weights) * dt.itemsize + kept
    if not precision.has_quantized_layers or (how.needs_gguf and precision.stored is None):
        return count * dt.itemsize  # float; gguf without its file: counted as float
    extra = 0
    if how.quantizes:
        count, extra = _logits_layer(cfg, precision, dev, dt, count)
    # the linears (unless a format stores only experts) and the routed experts (quant/experts.py)
    # of a stored checkpoint, as stored or requantized; a float one's linears
    shapes = Counter(_routed_expert_shapes(cfg)) if precision.stored is not None else Counter()
    if precision.stored is None or precision.stored.holds == "linears" or how.quantizes:
        shapes += Counter(quantized_linear_shapes(cfg))
    for (out_features, in_features), n in shapes.items():
        count -= out_features * in_features * n
        extra += precision.layer_bytes(out_features, in_features) * n
    if precision.calibrated:  # calibrated smoothing, float outlier channels
        from batchrun.models.quant.smoothquant import smoothed_bytes

        smoothed = quantized_linear_shapes(cfg, smoothed=True)
        extra += sum(smoothed_bytes(*shape) * n for shape, n in smoothed.items())
    return count * dt.itemsize + extra


def _logits_layer(cfg, precision, dev: torch.device, dt: torch.dtype, count: int) -> tuple[int, int]:
    """(parameters counted in `dt`, extra bytes) once a quantizing method holds the logits layer
    its own way: calibrated int8's smoothed int8 layer (quant/smoothquant.py LOGITS), or an
    uncalibrated int8's bfloat16 one (Method.logits_in_bf16); else as counted."""
    logits = cfg.vocab_size * cfg.hidden_size
    if precision.calibrated and not cfg.num_labels:
        from batchrun.models.quant.int8_linear import Int8Linear
        from batchrun.models.quant.smoothquant import LOGITS_OUTLIERS, smoothed_bytes

        held = (Int8Linear.nbytes(cfg.vocab_size, cfg.hidden_size)
                + smoothed_bytes(cfg.vocab_size, cfg.hidden_size, LOGITS_OUTLIERS))
    elif precision.method.logits_in_bf16():
        held = logits * 2  # bfloat16
    else:
        return count, 0
    if not cfg.tie_word_embeddings or _packs_tied_logits(cfg, dev, dt):
        count -= logits  # in place of a dt copy of the logits matrix
    return count, held


def is_native(cfg) -> bool:
    return isinstance(cfg, ModelConfig)


def _backend_bytes(cfg, whole: int | None, dt: torch.dtype, precision) -> int:
    """weights_bytes of a transformers-backend model under --quantization: its decoder's linears
    at the method's size (models/transformers/quantized.py), the rest in `dt` (a vision-language
    model's `whole` parameters as built; a text model's as unquantized)."""
    from batchrun.models.quant.smoothquant import smoothed_bytes

    held = whole * dt.itemsize if whole is not None else weights_bytes(cfg, dt)
    if not precision.method.quantizes:
        return held
    shapes = _meta_counts(cfg.hf_config)[3]
    smoothing = smoothed_bytes if precision.calibrated else lambda o, i: 0  # every linear's
    return held + sum((precision.layer_bytes(o, i) + smoothing(o, i) - o * i * dt.itemsize) * n
                      for (o, i), n in shapes.items())


def quantized_linear_shapes(cfg: ModelConfig, smoothed: bool = False) -> dict[tuple[int, int], int]:
    """(out, in) -> how many of the native model's linears of that shape --quantization
    replaces: all but the logits layer and MoE routers (quant.KEEP_FLOAT); with `smoothed`,
    those int8 smooths (quant/smoothquant.py targets: an MoE's attention only, as the model's
    layout names them). Read off the model built on the meta device (30 ms for a 70B Llama)."""
    from batchrun.models.arch import native
    from batchrun.models.quant import kept_float

    with native.no_init(), torch.device("meta"):
        model = native.native_module(cfg.hf_config).Model(cfg)
    if smoothed:
        from batchrun.models.quant.smoothquant import targets

        return dict(Counter((m.out_features, m.in_features) for m, _ in targets(model).values()))
    return dict(Counter((m.out_features, m.in_features) for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)
                        and not kept_float(name)))


def kv_reservation(engine_config: EngineConfig, cfg: ModelConfig,
                   device: torch.device | str = "cpu",
                   dtype: torch.dtype | str | None = None) -> tuple[int, int]:
    """(blocks, bytes) of the KV pool the engine will reserve, by the rule build_engine uses
    (engine/kv_sizing.py: kv_cache_memory or num_blocks, else a share of free memory,
    never more than max_num_seqs full-length sequences). `dtype` is the model dtype (None = the
    engine config's); kv_cache_dtype applies on top. Bytes include the one padding block the
    runner adds, an fp8 cache's scales (a K and a V float32 per layer; an int8 cache's per
    token and KV head are in the blocks) and a stateful model's state slots; on the CPU they are
    reserved, and touched (resident) only as blocks fill."""
    from batchrun.engine.kv_groups import kv_block_bytes
    from batchrun.engine.kv_sizing import state_bytes

    dev = device_of(device)
    dt = dtype_of(dtype if dtype is not None else engine_config.device.dtype, dev)
    from batchrun.llm import kv_layout_for

    num_blocks, _, kv_dtype = kv_layout_for(engine_config, cfg, dev, dt)
    per_block = kv_block_bytes(cfg, engine_config.cache.block_size, kv_dtype.itemsize,
                               4 if kv_dtype == torch.int8 else 0)
    scales = 2 * 4 * cfg.num_layers if kv_dtype.is_floating_point and kv_dtype.itemsize == 1 else 0
    # a model with recurrent state also holds a slot per sequence (engine/state_slots.py)
    return num_blocks, (num_blocks + 1) * per_block + scales + state_bytes(engine_config, cfg, dev)


def model_config_for(model: str | None, impl: str = "auto", trust_remote_code: bool = False):
    """The config of `model` (registry name, HF folder, .gguf file, hub id; None = the default
    model) as the path `impl` (--model-impl) picks runs it, without loading, converting or
    downloading its weights: config.json of the folder or of the GGUF's cached conversion,
    else the GGUF's metadata (a few seconds for the bundled model), else the hub's config.json.
    A native model's ModelConfig (models/arch/native.py: Llama family, MoE), a vision-language
    model's decoder (vision_language_decoder), else the transformers backend's BackendConfig
    read from the config (backend_config). UnsupportedModelError says why no path runs it;
    ModelFolderError what is wrong with its files (models/config/sizes.py,
    models/weights/remote_code.py)."""
    from batchrun.models.arch import native
    from batchrun.models.config.spec_config import config_for
    from batchrun.models.transformers.support import choose

    hf = config_for(model, trust_remote_code)
    try:
        verdict = choose(hf, impl)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{exc}; `batchrun models check {model or 'default'}` "
                                    "describes it") from exc
    if verdict.impl == "native":
        return native.native_module(hf).ModelConfig.from_hf(hf)
    return vision_language_decoder(hf) or backend_config(hf)


def backend_config(hf):
    """The transformers backend's config for `hf` as the engine will build it at load
    (model.config_of): each layer's attention shape and window as its modelling code calls
    attention, read by a forward pass of transformers' model on the meta device (no weights,
    no memory: check.shapes_from_config); where that forward cannot run on meta tensors, as
    the config's fields describe them (models check's attention_shape, config_layer_windows)."""
    from batchrun.models.transformers import check, stateful
    from batchrun.models.transformers.model import config_of
    from batchrun.models.config.windows import config_layer_windows
    from batchrun.models.transformers.support import as_transformers_config

    full = as_transformers_config(hf)
    text = full.get_text_config()
    layers, state, checkpoints = frozenset[int](), 0, False
    if stateful.runs(full):  # its state counted in float32 (the most it takes)
        meta = check.meta_model(full)
        if meta is None:
            raise UnsupportedModelError(f"transformers cannot build {text.model_type} from its "
                                        "config")
        spec = stateful.spec_of(meta, torch.float32)
        if not stateful.has_attention(meta):
            return stateful.backend_config(meta, spec)
        layers, state = stateful.no_kv_layers(meta), spec.bytes_per_sequence
        checkpoints = spec.checkpoints
    calls: dict = {}
    try:
        shapes, windows = check.shapes_from_config(full, calls=calls)
    except UnsupportedModelError:
        raise
    except Exception:  # data-dependent code in its forward: the config's own description
        shape = (text.num_attention_heads, *check.attention_shape(text))
        shapes = {i: shape for i in range(text.num_hidden_layers) if i not in layers}
        windows = dict(enumerate(config_layer_windows(text)))
    config = dataclasses.replace(config_of(text, shapes, windows, calls, layers),
                                 state_bytes_per_sequence=state, state_checkpoints=checkpoints)
    if getattr(full, "vision_config", None) is not None:  # its weights: the whole model's
        config = dataclasses.replace(config, hf_config=full)
    return config


def vision_language_decoder(hf) -> ModelConfig | None:
    """A vision-language model's decoder as a native-shaped ModelConfig (its KV shape, and the
    shape plan's cost model times), `hf_config` the whole model's; None for any other model or a
    decoder that is not Llama/Qwen2-shaped. Its weights: vision_language_parameters."""
    if getattr(hf, "vision_config", None) is None or not hasattr(hf, "get_text_config"):
        return None
    import copy

    from batchrun.models.arch.native import NATIVE_MODULES

    text = copy.copy(hf.get_text_config())
    model_type = str(getattr(text, "model_type", ""))
    qwen = model_type.startswith("qwen2")
    if not (qwen or model_type in NATIVE_MODULES):  # Gemma 3's: as the backend runs it
        return None
    text.architectures = ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"]
    try:
        cfg = ModelConfig.from_hf(text)
    except (ValueError, AttributeError):
        return None
    return dataclasses.replace(cfg, qkv_bias=cfg.qkv_bias or qwen, hf_config=hf)


def vision_language_parameters(cfg: ModelConfig) -> int | None:
    """Parameters of a vision-language model (vision tower, projector, decoder) as transformers
    builds it from the config, on the meta device (no memory, no weights read); None for a
    model of the native path."""
    hf = cfg.hf_config
    if getattr(hf, "vision_config", None) is None:
        return None
    from transformers import AutoModelForImageTextToText

    from batchrun.models.weights.remote_code import config_kwargs

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf, **config_kwargs(hf))
    return sum(p.numel() for p in model.parameters())


def tokenizer_model(spec: str | None, max_model_len: int | None = None,
                    trust_remote_code: bool = False) -> TokenizerModel:
    """What prepare_line needs of a model (tokenizer, names, context length, generation
    defaults, the embeddings' width), without its weights: `validate --check-prompts`, `plan`
    and a Ray run's driver check lines exactly as `run` does."""
    from batchrun.llm import read_generation_config
    from batchrun.models.config.hf_config import read_raw
    from batchrun.models.weights.resolve import resolve_model
    from batchrun.models.text.tokenizer import load_tokenizer

    files = resolve_model(spec, trust_remote_code)
    config = read_raw(files.path, trust_remote_code)
    context = config.get("max_position_embeddings") or \
        config.get("text_config", {}).get("max_position_embeddings") or max_model_len or 2048
    if max_model_len:
        context = min(context, max_model_len)
    defaults, _ = read_generation_config(files.path)
    processor = None
    if config.get("vision_config") is not None:  # renders image lines as the run would
        from batchrun.models.transformers.processor import load_processor, processor_class

        if processor_class(files.path) is not None:  # without one: a text model, as in run
            processor = load_processor(files.path, trust_remote_code)
    return TokenizerModel(load_tokenizer(files.path, trust_remote_code), files.name,
                          tuple(files.aliases), max_model_len=context, generation_defaults=defaults,
                          hidden_size=config.get("hidden_size"), processor=processor,
                          path=files.path)
