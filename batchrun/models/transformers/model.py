"""A transformers causal LM presented to the engine as the native model is: `config` (the KV shape
the runner sizes its cache from), `model(input_ids, positions, kv_caches, meta) -> hidden` (final
hidden states, after the final norm) and `compute_logits(hidden)`.

The step's tokens go in as one row [1, T] with the step's positions as position_ids, no padding
and no transformers cache; attention runs through the "batchrun" attention function
(attention.py) on the engine's paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from batchrun.models.layers import packed_linear
from batchrun.models.config.classifier import classifier_labels
from batchrun.models.config.windows import config_layer_chunks, layer_chunk
from batchrun.models.transformers import (attention, indexed, inline, own_forward,
                                          plain_linears, probe, shared_attention,
                                          temperature)
from batchrun.models.transformers.support import (WINDOW_FROM_MASK, UnsupportedModelError,
                                                  base_decoder)
from batchrun.models.transformers.weights_check import weights_reason
from batchrun.models.quant.methods import METHODS, Method

if TYPE_CHECKING:  # transformers' modelling code loads with the backend, not with this module
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class BackendConfig:
    """What the runner, the engine and the KV sizing read from a model's config."""
    vocab_size: int
    hidden_size: int
    # KV caches: one per attention call of a step (decoder_layers x calls_per_layer)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of the cache: the wider of the K and V head dims
    max_position_embeddings: int
    tie_word_embeddings: bool
    hf_config: object
    # Each KV cache's sliding window as the probe saw it attend (None: full); KV groups read it.
    layer_windows: tuple = ()
    # Each KV cache's attention chunk (None: not chunked) as layer_types says; KV groups read it.
    layer_chunks: tuple = ()
    decoder_layers: int = 0  # the decoder's layers (0: num_layers)
    calls_per_layer: int = 1  # attention calls per layer and step (DiffLlama: 2)
    # One sequence's recurrent state (stateful.py; engine/state_slots.py), 0 for none: the KV
    # sizing pays for a slot per sequence out of the same budget.
    state_bytes_per_sequence: int = 0
    # Its stateful layers save their state at block boundaries (StateSpec.checkpoints): the
    # KV sizing also pays for the prefix cache's state checkpoints.
    state_checkpoints: bool = False
    # The decoder layers that attend, where not all do (a hybrid's other layers keep state:
    # stateful.py); (): every layer. KV cache i belongs to the i-th of them.
    attention_layers: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def logit_transforms(hf) -> list:
    """What the architecture's causal-LM head does to lm_head's output (the probe at load time
    checks this list against transformers' own forward)."""
    ops = []
    if getattr(hf, "logit_scale", None) is not None:  # Cohere
        ops.append(lambda x, s=hf.logit_scale: x * s)
    if getattr(hf, "logits_scaling", None) not in (None, 1, 1.0):  # Granite
        ops.append(lambda x, s=hf.logits_scaling: x / s)
    if getattr(hf, "output_multiplier", None) not in (None, 1, 1.0):  # MuseGlimmer, before its cap
        ops.append(lambda x, s=hf.output_multiplier: x * s)
    cap = getattr(hf, "final_logit_softcapping", None) or getattr(hf, "logits_soft_cap", None) \
        or getattr(hf, "output_logit_soft_cap", None)  # Gemma 2/3; RecurrentGemma; xLSTM
    if cap:
        ops.append(lambda x, c=cap: torch.tanh(x / c) * c)
    return ops


# Causal-LM heads that put modules before the output embeddings as siblings of them, by the
# attribute that holds them (Electra's generator_predictions, ModernBERT-decoder's lm_head:
# dense, activation, norm); where that attribute is the output embeddings, it is not one.
HEAD_BEFORE_EMBEDDINGS = ("generator_predictions", "lm_head")


def head(hf) -> nn.Module | Callable[[torch.Tensor], torch.Tensor]:
    """What maps final hidden states to the head's logits (before logit_transforms): the output
    embeddings, or the module that holds them where the head transforms first (BERT's cls:
    predictions.transform then the decoder; RoBERTa's lm_head: dense, activation, norm, decoder),
    or the modules HEAD_BEFORE_EMBEDDINGS names before them."""
    out = hf.get_output_embeddings()
    for name in HEAD_BEFORE_EMBEDDINGS:
        before = getattr(hf, name, None)
        if isinstance(before, nn.Module) and not any(m is out for m in before.modules()):
            return lambda hidden: out(before(hidden))
    base = base_decoder(hf)
    for child in hf.children():
        if child is not out and child is not base and any(m is out for m in child.modules()):
            return child
    return out


def first_position(hf) -> int:
    """The position a sequence's first token has: RoBERTa's family counts absolute positions from
    after its padding index (its embeddings' create_position_ids_from_input_ids); 0 elsewhere."""
    embeddings = getattr(base_decoder(hf), "embeddings", None)
    padding = getattr(embeddings, "padding_idx", None)
    if hasattr(embeddings, "create_position_ids_from_input_ids") and padding is not None:
        return int(padding) + 1
    return 0


class TransformersModel(nn.Module):
    def __init__(self, hf_model: PreTrainedModel, config: BackendConfig):
        super().__init__()
        self.hf = hf_model
        self.config = config
        # what compute_logits does to lm_head's output (the load's probe checks it)
        self.transforms = logit_transforms(hf_model.config.get_text_config())
        self.position_offset = first_position(hf_model)
        # A *ForSequenceClassification model: its `score` head's outputs; 0 for a causal LM.
        self.num_labels = len(classifier_labels(hf_model.config) or ())
        # Qualified names of the linears its modelling code uses directly (wrap finds them).
        self.plain_linears: frozenset[str] = frozenset()
        # layer_idx -> KV index where only some layers attend (attention.Step.layers)
        self.kv_index = {layer: i for i, layer in enumerate(config.attention_layers)} or None

    @property
    def decoder(self) -> nn.Module:
        return base_decoder(self.hf)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat row of tokens of one step."""
        with attention.step(kv_caches, meta, max_context(meta, positions),
                            calls_per_layer=self.config.calls_per_layer, layers=self.kv_index,
                            kv_shape=(self.config.num_kv_heads, self.config.head_dim)):
            out = self.decoder(input_ids=input_ids[None],
                               position_ids=positions[None] + self.position_offset, use_cache=False)
        return out[0][0]

    def lora_targets(self):
        """The plain linears of the decoder layers, named as PEFT names them on this model;
        ValueError when its decoder layers are not found."""
        from batchrun.models.lora.targets import linear_targets

        return linear_targets(self.hf, self.decoder,
                              self.config.decoder_layers or self.config.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = head(self.hf)(hidden)  # looked up each call: pack() swaps the linears in it
        for op in self.transforms:
            logits = op(logits)
        return logits.float()

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sequence-classification head's logits [N, num_labels] of final hidden states."""
        return self.hf.get_submodule("score")(hidden).float()


def max_context(meta, positions: torch.Tensor) -> int:
    if meta.context_lens is not None:
        return int(meta.context_lens.max())
    return int(positions.max()) + 1


def load(path, device: torch.device, dtype: torch.dtype, quantization: Method = METHODS["none"],
         trust_remote_code: bool = False) -> TransformersModel:
    """The model at `path` (safetensors, sharded or not, as transformers maps them onto its own
    modules), its decoder's linears quantized by `quantization` (quantized.py), probed for its
    real attention shape, checked against transformers' own forward (own_forward.py: a
    LoadCheckError where the engine's logits differ); UnsupportedModelError when it cannot
    run."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from batchrun.models.weights.remote_code import auto_kwargs

    attention.register()
    trust = auto_kwargs(trust_remote_code)
    config = AutoConfig.from_pretrained(path, **trust)
    auto = AutoModelForSequenceClassification if classifier_labels(config) else AutoModelForCausalLM
    hf = from_pretrained_checked(auto, path, dtype=dtype, device_map=device,
                                 attn_implementation=inline.load_implementation(
                                     config, attention.NAME), **trust)
    reason = weights_reason(hf)
    if reason:
        raise UnsupportedModelError(f"unsupported model: {reason}")
    model = wrap(hf.eval(), quantization=quantization, path=path)
    if device.type == "cpu" and packed_linear.available(dtype):  # as the native model's
        pack(model)
    own_forward.check(model, f"{path}", quantized=quantization.quantizes)
    return model


def from_pretrained_checked(auto, path, **kwargs):
    """auto.from_pretrained(path, **kwargs); UnsupportedModelError where transformers cannot
    build the model, and a ModelFolderError naming the checkpoint where transformers would
    complete it with random weights (a tensor missing, or of another shape than the config
    gives: it re-initialises those) or cast integer or boolean tensors into a float model."""
    from pathlib import Path

    from batchrun.models.errors import ModelFolderError
    from batchrun.models.weights.safetensors_check import holding, named, non_float_tensors

    files = sorted(Path(path).glob("*.safetensors"))
    odd = non_float_tensors(files)
    if odd:
        raise ModelFolderError(f"{odd[0][0]}: weight {odd[0][1]!r} is stored as {odd[0][2]}; "
                               "the model needs floating-point values")
    try:
        hf, info = auto.from_pretrained(path, output_loading_info=True,
                                        ignore_mismatched_sizes=True, **kwargs)
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"transformers cannot build it on this backend: {exc}") from exc
    where = named(files, path)
    if info.get("mismatched_keys"):
        name, got, want = sorted(info["mismatched_keys"])[0]
        raise ModelFolderError(f"{holding(files, name) or where}: weight {name!r} has shape "
                               f"{list(got)}; the config makes it {list(want)}")
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ModelFolderError(f"{where}: the checkpoint lacks weights: {missing[:5]}"
                               f"{'…' if len(missing) > 5 else ''}")
    return hf


def use_batchrun_attention(hf) -> None:
    """Point `hf`'s attention at the "batchrun" function (its decoder's, for a vision-language
    model; Llama 4's temperature tuning moved into it: temperature.py), or for a family whose attention modules do not call AttentionInterface, replace
    their forwards (inline/)."""
    attention.register()
    temperature.take_over(hf)
    shared_attention.install(hf, hf.config.get_text_config().model_type)
    cfg = hf.config.get_text_config()
    if inline.replaces(cfg):
        inline.install(hf, attention.NAME)
    else:
        hf.set_attn_implementation(attention.implementation(hf.config, cfg))
    indexed.install(hf, attention.current_step)
    if cfg.model_type in WINDOW_FROM_MASK and getattr(cfg, "sliding_window", None):
        for module in hf.modules():  # the attention modules (those that know their layer)
            if hasattr(module, "layer_idx"):
                module.batchrun_window = cfg.sliding_window


def config_of(cfg, shapes: dict, windows: dict, calls: dict | None = None,
              no_kv: frozenset[int] = frozenset(), first: int = 0) -> BackendConfig:
    """The engine's config of a model whose text config is `cfg`, from what the probe saw its
    layers attend (probe.run, or check.shapes_from_config without weights): one KV shape, and
    as many attention calls per step in every layer (`calls`, layer_idx -> count; each call
    gets a KV cache of its own). A hybrid's `no_kv` layers (stateful.py: those that keep state,
    or are only an MLP) do not attend; positions start at `first` (first_position)."""
    layers = cfg.num_hidden_layers
    attending = sorted(shapes)
    if set(range(layers)) - set(attending) - no_kv or not attending:
        raise UnsupportedModelError(
            f"{cfg.model_type}: attention ran for layers {attending} of {layers}; the "
            f"backend needs attention calls in every layer, indexed by layer_idx")
    per_layer = set((calls or {}).values()) or {1}
    if len(per_layer) > 1:
        raise UnsupportedModelError(f"{cfg.model_type}: its layers call attention different "
                                    f"numbers of times per step ({sorted(per_layer)})")
    repeat = per_layer.pop()
    heads, kv_heads, dk, dv = one_kv_shape(cfg.model_type, set(shapes.values()))
    longest = (getattr(cfg, "max_position_embeddings", None) or 2048) - first
    # indexed.py: capped where the indexer's selection does not run on the cache
    longest = min(longest, indexed.dense_context(cfg) or longest)
    return BackendConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=len(attending) * repeat, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=indexed.cache_head_dim(cfg, kv_heads, dk, dv), max_position_embeddings=longest,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), hf_config=cfg,
        layer_windows=tuple(w if w and w < longest else None
                            for w in (windows.get(i) for i in attending for _ in range(repeat))),
        layer_chunks=tuple(layer_chunk(cfg, i) for i in attending for _ in range(repeat))
        if config_layer_chunks(cfg) else (),
        decoder_layers=layers, calls_per_layer=repeat,
        attention_layers=tuple(attending) if len(attending) < layers else ())


def one_kv_shape(model_type: str, distinct: set) -> tuple[int, int, int, int]:
    """The (heads, KV heads, K dim, V dim) one KV cache holds for layers of these shapes: layers
    of the same query heads but fewer KV heads (a multiple of them) or narrower heads fit it
    (attention.fit_cache); other differences are refused."""
    heads = {s[0] for s in distinct}
    kv_heads = max(s[1] for s in distinct)
    if len(heads) > 1 or any(kv_heads % s[1] or s[0] % kv_heads for s in distinct):
        raise UnsupportedModelError(f"{model_type}: attention shapes differ between layers "
                                    f"({sorted(distinct)}); the KV cache has one shape")
    return heads.pop(), kv_heads, max(s[2] for s in distinct), max(s[3] for s in distinct)


def wrap(hf: PreTrainedModel, cls=TransformersModel, quantization: Method = METHODS["none"],
         path=None, no_kv: frozenset[int] = frozenset()) -> TransformersModel:
    """`hf` (its attention implementation set to "batchrun"; its decoder quantized by
    `quantization`, calibrated on the checkpoint at `path`) as the engine's model, after a probe
    forward over a few tokens: every layer must attend through the paged cache with one KV
    shape, and compute_logits must reproduce transformers' own logits. The linears its
    modelling code uses directly (plain_linears.py) stay nn.Linear: `model.plain_linears`."""
    cfg = hf.config.get_text_config()  # a vision-language model's decoder's
    use_batchrun_attention(hf)
    plain: set[str] = set()
    if quantization.quantizes:
        from batchrun.models.transformers.quantized import quantize_decoder

        plain = plain_linears.find(hf, lambda: _probe(hf, cfg, full=True))  # on the float model
        with inline.suspended(hf), temperature.restored(hf):  # its own forwards calibrate
            quantize_decoder(hf, quantization, path, keep=plain)
        use_batchrun_attention(hf)  # the calibration ran on SDPA
    windows: dict = {}
    calls: dict = {}
    with plain_linears.traced(hf) as used:
        hidden, shapes = _probe(hf, cfg, windows=windows, calls=calls)
        config = config_of(cfg, shapes, windows, calls, no_kv, first_position(hf))
        model = cls(hf, config)
        probe.check_logits(model, hidden)
    model.plain_linears = frozenset(plain | used | plain_linears.static(hf))
    if quantization.quantizes:  # after the probe, whose two forwards must round alike
        from batchrun.engine import kernels
        from batchrun.models.quant.int8_linear import attach_kernels

        library = kernels.library(kernels.shape_flags(config.num_heads, config.num_kv_heads,
                                                      config.head_dim))
        if library is not None:  # the int8 layers' quantize and rescale passes in C
            attach_kernels(hf, library)
    return model


def _probe(hf: PreTrainedModel, cfg, full: bool = False, windows: dict | None = None,
           calls: dict | None = None):
    """probe.run over the decoder (with `full`, the whole causal LM); UnsupportedModelError
    where the modelling code fails on the flat step."""
    first = first_position(hf)

    def decoder(ids, pos):
        pos = pos + first
        return base_decoder(hf)(input_ids=ids, position_ids=pos, use_cache=False)[0][0]

    def causal_lm(ids, pos):
        pos = pos + first
        return hf(input_ids=ids, position_ids=pos, use_cache=False).logits

    try:
        return probe.run(hf, causal_lm if full else decoder, windows, calls)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # its modelling code does something the flat step cannot feed
        raise UnsupportedModelError(f"{cfg.model_type}: a forward pass on the transformers "
                                    f"backend failed: {type(exc).__name__}: {exc}") from exc


def pack(model: TransformersModel) -> int:
    """Pack the float linears of a wrapped model for oneDNN, but those it keeps plain; how many."""
    return packed_linear.pack_linears(model.hf, keep=model.plain_linears)
