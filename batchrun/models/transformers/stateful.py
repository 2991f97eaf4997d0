"""Models whose layers keep recurrent state, on the transformers backend with the engine
owning the state (engine/state_slots.py).

`StateModel` declares one sequence's state (its `state_spec`, from the model's own modules) and
runs a step as TransformersModel does, the step's StepState set for its duration (`step`): each
stateful layer's forward is replaced by one that reads and writes the step's slots (mamba.py
for transformers' MambaMixer), and runs transformers' own forward when no step is set (the load
check's reference, transformers' generate on the same module). The layers are found by their
class, not by the model's name: any model built of them runs. A module whose forward also
writes the step's state checkpoints (StepState.checkpoints: the state after given rows of a
chunk) says so (`WRITES_CHECKPOINTS`); any other runs a step with checkpoints in pieces that end
at them (engine/state_checkpoint_pieces.py), so every model takes prefix-cache hits
(engine/state_checkpoints.py).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import replace
import torch

from batchrun.engine import state_checkpoint_pieces
from batchrun.engine.state_slots import StateSpec, StepState
from batchrun.models.transformers import (attention, gated_delta, kimi_delta, lightning, mamba,
                                          mamba2, rglru, rwkv, shared_attention, short_conv,
                                          xlstm, zamba_mamba)
from batchrun.models.quant.methods import METHODS, Method
from batchrun.models.transformers.model import (BackendConfig, TransformersModel,
                                                from_pretrained_checked, pack)
from batchrun.models.transformers.support import (ATTENTION_LAYER_TYPES, STATE_MODEL_TYPES,
                                                  UnsupportedModelError)

# transformers' stateful layer classes this backend runs -> the module that runs them
# Bamba's, Granite-4's and Nemotron-H's mixers are Mamba-2's (its maths under their own
# config names), beside attention layers, and so are Zamba 2's; Jamba's and Falcon-Mamba's
# are Mamba's with norms, Zamba's Mamba's split into heads (zamba_mamba.py);
# LFM2's short convolutions keep a convolution state only; Qwen3-Next's, Qwen3.5's and
# OLMo-Hybrid's Gated DeltaNets and Kimi Linear's delta attention a convolution and a
# linear-attention state; MiniMax's lightning attention a decaying key-value state only;
# RecurrentGemma's recurrent blocks a convolution and an RG-LRU state; RWKV's time and channel
# mixing their last input (and the WKV sums); xLSTM's mLSTM layers a matrix memory.
MIXERS = {mamba.MIXER: mamba, mamba2.MIXER: mamba2, "BambaMixer": mamba2,
          "GraniteMoeHybridMambaLayer": mamba2, "NemotronHMamba2Mixer": mamba2,
          "JambaMambaMixer": mamba, "FalconMambaMixer": mamba, "FalconH1Mixer": mamba2,
          "Zamba2MambaMixer": mamba2, zamba_mamba.MIXER: zamba_mamba,
          short_conv.MIXER: short_conv, "Lfm2MoeShortConv": short_conv,
          kimi_delta.MIXER: kimi_delta, lightning.MIXER: lightning, rglru.MIXER: rglru,
          **{name: gated_delta for name in gated_delta.MIXERS},
          xlstm.MIXER: xlstm, **{name: rwkv for name in rwkv.MIXERS}}
# The context a model without position embeddings (Mamba) is given: a nominal length, which
# --max-model-len can only lower.
NOMINAL_CONTEXT = 32768

_current: StepState | None = None


@contextlib.contextmanager
def step(state: StepState | None):
    global _current
    previous, _current = _current, state
    try:
        yield
    finally:
        _current = previous


def runs(config) -> bool:
    """Whether the backend runs `config`'s model through this module (its family's layers are
    all of a class in MIXERS)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds and kinds <= ATTENTION_LAYER_TYPES:  # an LFM2 whose layers all attend
        return False
    return getattr(text, "model_type", None) in STATE_MODEL_TYPES


def stateful_layers(hf) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each layer of a class in MIXERS, in order."""
    return [(name, m) for name, m in hf.named_modules() if type(m).__name__ in MIXERS]


def keeps_state(hf) -> bool:
    return bool(stateful_layers(hf))


class StateModel(TransformersModel):
    def __init__(self, hf_model, config: BackendConfig, spec: StateSpec):
        super().__init__(hf_model, config)
        self.state_spec = spec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                state: StepState | None = None) -> torch.Tensor:
        with step(state):
            return super().forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Mamba keeps its residual stream in float32 (residual_in_fp32): the head reads it in
        # the model's dtype, as transformers' causal LM casts it
        return super().compute_logits(hidden.to(self.hf.dtype))

    def lora_targets(self):
        raise ValueError("LoRA adapters do not run on models with recurrent state yet")


def install(hf) -> None:
    """Replace the forwards of hf's stateful layers (the i-th reads the step's i-th state)."""
    for index, (_, module) in enumerate(stateful_layers(hf)):
        kind = MIXERS[type(module).__name__]
        own = module.forward

        def forward(self, hidden_states, *args, _own=own, _kind=kind, _index=index, **kwargs):
            if _current is None:
                return _own(hidden_states, *args, **kwargs)
            tensors = _current.tensors[_index]
            if len(_current.checkpoints) and not getattr(_kind, "WRITES_CHECKPOINTS", False):
                return in_pieces(_kind, self, hidden_states, tensors, _current)
            return _kind.forward(self, hidden_states, tensors, _current)

        module.forward = types.MethodType(forward, module)


def in_pieces(kind, module, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
              state: StepState):
    """`kind`'s forward of a step with state checkpoints, for a mixer that saves only final
    states: run in pieces ending at the checkpoints (engine/state_checkpoint_pieces.py). Its
    output as the mixer's forward gives it ([1, T, hidden], or that and None)."""
    tupled = False

    def piece(rows: torch.Tensor, part: StepState) -> torch.Tensor:
        nonlocal tupled
        out = kind.forward(module, hidden[:, rows], tensors, part)
        tupled = isinstance(out, tuple)
        return (out[0] if tupled else out)[0]

    out = state_checkpoint_pieces.run(state, tensors, piece)[None]
    return (out, None) if tupled else out


def spec_of(hf, dtype: torch.dtype) -> StateSpec:
    """One sequence's state of hf's stateful layers, kept in `dtype` (the model's); they take
    prefix-cache hits: every mixer writes state checkpoints, itself (WRITES_CHECKPOINTS) or
    run in pieces (`in_pieces`)."""
    kinds = [MIXERS[type(m).__name__] for _, m in stateful_layers(hf)]
    return StateSpec(tuple(kind.state_tensors(m, dtype)
                           for kind, (_, m) in zip(kinds, stateful_layers(hf))),
                     checkpoints=bool(kinds))


def attention_layer_ids(hf) -> frozenset[int]:
    """The decoder layers (layer_idx) with an attention module (a hybrid's: Bamba's), by
    transformers' naming of those modules (Zamba's shared blocks: the layers they serve)."""
    shared = shared_attention.layers(hf.config.get_text_config())
    if shared is not None:
        return shared
    return frozenset(int(getattr(m, "layer_idx")) for m in hf.modules()
                     if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
                     and type(m).__name__ not in MIXERS)  # Kimi's delta "attention" keeps state


def has_attention(hf) -> bool:
    return bool(attention_layer_ids(hf))


def no_kv_layers(hf) -> frozenset[int]:
    """The decoder layers without attention (a hybrid's mixers, MLP-only layers)."""
    return frozenset(range(hf.config.get_text_config().num_hidden_layers)) - \
        attention_layer_ids(hf)


def backend_config(hf, spec: StateSpec) -> BackendConfig:
    """The engine's config of `hf` without attention layers (weights loaded or on the meta
    device: footprint.py, models check): no KV cache, the state `spec` per sequence."""
    cfg = hf.config.get_text_config()
    return BackendConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=0, num_heads=1,
        num_kv_heads=1, head_dim=1,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or NOMINAL_CONTEXT,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), hf_config=cfg,
        decoder_layers=cfg.num_hidden_layers, state_bytes_per_sequence=spec.bytes_per_sequence,
        state_checkpoints=spec.checkpoints)


def load(path, device: torch.device, dtype: torch.dtype, quantization: Method = METHODS["none"],
         trust_remote_code: bool = False) -> StateModel:
    """model.load's counterpart for a model `runs` says this module runs: its stateful layers
    installed, its attention layers (a hybrid's) on the paged cache, checked against
    transformers' own forward as every backend model is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchrun.models.layers import packed_linear
    from batchrun.models.transformers import inline, own_forward
    from batchrun.models.weights.remote_code import auto_kwargs

    if quantization.quantizes:
        raise UnsupportedModelError(f"--quantization {quantization.name} does not run models "
                                    "with recurrent state yet")
    trust = auto_kwargs(trust_remote_code)
    attention.register()
    implementation = inline.load_implementation(AutoConfig.from_pretrained(path, **trust),
                                                attention.NAME)
    hf = from_pretrained_checked(AutoModelForCausalLM, path, dtype=dtype, device_map=device,
                                 attn_implementation=implementation, **trust)
    model = wrap(hf.eval())
    if device.type == "cpu" and packed_linear.available(dtype):
        pack(model)
    own_forward.check(model, f"{path}")
    return model


def wrap(hf) -> StateModel:
    """`hf` as the engine's model: a hybrid's attention layers probed as model.wrap probes any
    model's (its stateful layers need not attend), then the stateful layers installed."""
    from batchrun.models.transformers.model import wrap as wrap_attention

    spec = spec_of(hf, hf.dtype)
    if has_attention(hf):
        def state_model(hf_model, config: BackendConfig) -> StateModel:
            return StateModel(hf_model, replace(
                config, state_bytes_per_sequence=spec.bytes_per_sequence,
                state_checkpoints=spec.checkpoints), spec)

        model = wrap_attention(hf, cls=state_model, no_kv=no_kv_layers(hf))
    else:
        attention.register()
        model = StateModel(hf, backend_config(hf, spec), spec)
    assert isinstance(model, StateModel)
    install(hf)
    # transformers' own forward (the reference) reads these linears' weights directly
    head = hf.get_output_embeddings()
    model.plain_linears = model.plain_linears | frozenset(
        [f"{name}.dt_proj" for name, module in stateful_layers(hf) if hasattr(module, "dt_proj")]
        + [f"{name}.{linear}" for name, module in stateful_layers(hf)
           for linear in getattr(MIXERS[type(module).__name__], "plain_linears",
                                 lambda _: ())(module)]
        + [n for n, m in hf.named_modules() if m is head])
    return model

