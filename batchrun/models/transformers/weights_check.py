"""Refusals that depend on a checkpoint's weights, not its config: an architecture the backend
runs whose loaded weights switch on something the paged attention does not compute."""

from __future__ import annotations

import torch


def weights_reason(hf) -> str | None:
    """Why the backend cannot run the loaded model `hf` (None: nothing in its weights stops it)."""
    if hf.config.get_text_config().model_type == "doge" and any(
            bool(torch.any(module.A != 0)) for module in hf.modules()
            if type(module).__name__ == "DogeAttention"):
        return ("doge's dynamic mask attention adds to each score a bias learned from the key's "
                "values (its A is not zero) and keeps only the keep_window_size keys that bias "
                "ranks first; the paged attention computes neither")
    return None
