"""A vision-language model whose decoder keeps recurrent state (Qwen3.5's Gated DeltaNet layers
beside attention): vision.py's image path, with the step's state slots set for the decoder's
stateful layers as stateful.py sets them for a text model."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchrun.engine.state_slots import StateSpec, StepState
from batchrun.models.quant.methods import METHODS, Method
from batchrun.models.transformers import stateful, vision
from batchrun.models.transformers.model import BackendConfig
from batchrun.models.transformers.support import UnsupportedModelError


class StateVisionModel(vision.VisionLanguageModel):
    def __init__(self, hf_model, config: BackendConfig, spec: StateSpec):
        super().__init__(hf_model, config)
        self.state_spec = spec

    def forward(self, input_ids, positions, kv_caches, meta, images=(),
                state: StepState | None = None) -> torch.Tensor:
        with stateful.step(state):
            return super().forward(input_ids, positions, kv_caches, meta, images=images)

    def lora_targets(self):
        raise ValueError("LoRA adapters do not run on models with recurrent state yet")


def wrap(hf, quantization: Method = METHODS["none"], path=None) -> StateVisionModel:
    """The engine's model of `hf`: its attention layers probed as model.wrap probes any
    model's (its stateful layers need not attend), then its stateful layers installed."""
    from batchrun.models.transformers.model import wrap as wrap_attention

    if quantization.quantizes:
        raise UnsupportedModelError(f"--quantization {quantization.name} does not run models "
                                    "with recurrent state yet")
    spec = stateful.spec_of(hf, hf.dtype)

    def state_model(hf_model, config: BackendConfig) -> StateVisionModel:
        return StateVisionModel(hf_model, replace(
            config, state_bytes_per_sequence=spec.bytes_per_sequence,
            state_checkpoints=spec.checkpoints), spec)

    model = wrap_attention(hf, cls=state_model, no_kv=stateful.no_kv_layers(hf))
    assert isinstance(model, StateVisionModel)
    stateful.install(hf)
    return model


def load(path, device: torch.device, dtype: torch.dtype, quantization: Method = METHODS["none"],
         trust_remote_code: bool = False) -> vision.VisionLanguageModel:
    return vision.load(path, device, dtype, quantization, trust_remote_code, wrap_model=wrap)
