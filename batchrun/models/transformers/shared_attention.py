"""Attention modules one instance of which serves several decoder layers (Zamba's and Zamba 2's
shared transformer blocks): transformers builds them with layer_idx -1 and passes the layer
their forward runs for as an argument, while the "batchrun" attention function (attention.py)
picks a layer's KV cache by the module's layer_idx. `install` makes each call set the module's
layer_idx to the layer it runs for, so every layer the block serves reads and writes its own
KV cache (the probe, check.py's shapes and the engine's steps alike)."""

from __future__ import annotations

import types

# model type -> transformers' class of its shared attention modules
SHARED = {"zamba": "ZambaAttention", "zamba2": "Zamba2Attention"}


def install(hf, model_type: str) -> None:
    name = SHARED.get(model_type)
    if name is None:
        return
    for module in hf.modules():
        if type(module).__name__ != name or getattr(module, "batchrun_shared", False):
            continue
        own = module.forward

        def forward(self, *args, _own=own, **kwargs):
            self.layer_idx = int(kwargs["layer_idx"] if "layer_idx" in kwargs else args[1])
            return _own(*args, **kwargs)

        module.forward = types.MethodType(forward, module)
        module.batchrun_shared = True


def layers(config) -> frozenset[int] | None:
    """The layers a model of (text) `config` attends in through shared modules: its "hybrid"
    layers (None: not such a model)."""
    if config.model_type not in SHARED:
        return None
    return frozenset(i for i, kind in enumerate(config.layer_types) if kind == "hybrid")
