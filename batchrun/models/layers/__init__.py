"""Layers the native architectures share: norms-free building blocks (rotary tables, gated activations, grouped expert GEMMs, packed linears, bfloat16 logits)."""
