"""KV cache groups: the model's layers grouped by what they attend (the whole context, a
sliding window of W tokens, or their own chunk of C tokens: Llama 4's chunked local attention),
each group with its own block table per sequence.

All groups draw blocks from one pool (kv_cache.py) and share the physical cache: the pool's
block b holds, in each of `layers_per_block` K/V tensor pairs, one layer's K/V of the group
that owns b. A group holds at most `layers_per_block` layers, so a model with 1 full layer in
6 (Gemma 3) has its full layers in one group and its windowed ones split into groups of as
many, and a windowed group can hand its blocks behind the window back to the pool while the
full group keeps every block. A chunked group keeps its blocks as a window of C would: a query
at p sees from p - p % C, never before p - C + 1, so the window's blocks hold all it reads (up
to one chunk more than it needs, and the window groups' prefix-cache rules hold unchanged).
A model of one attention kind is one group of all its layers:
one block then holds every layer, as a cache without groups does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # a layer attends positions p - window < j <= p; None: all of 0..p
    layers: tuple[int, ...]
    chunked: bool = False  # the layers attend p - p % window <= j <= p (their chunk) only


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    layers_per_block: int  # K/V tensor pairs of the physical cache

    @classmethod
    def of(cls, layer_windows: Sequence[int | None],
           layer_chunks: Sequence[int | None] = ()) -> KVGroups:
        """Groups of layers of one kind each (a window, a chunk, or neither: layer_chunks[i]
        set makes layer i chunked), at most as many layers as the rarest kind has; the
        full-attention group (if any) first."""
        chunks = tuple(layer_chunks) or (None,) * len(layer_windows)
        kinds: dict[tuple[int | None, bool], list[int]] = {}
        for layer, (window, chunk) in enumerate(zip(layer_windows, chunks)):
            kinds.setdefault((window, False) if chunk is None else (chunk, True), []).append(layer)
        if not kinds:  # a model without layers (tests' scripted models)
            return cls.single(0)
        size = min(len(layers) for layers in kinds.values())
        full_first = sorted(kinds.items(), key=lambda kind: kind[0][0] is not None)
        groups = tuple(KVGroup(window, tuple(layers[i:i + size]), chunked)
                       for (window, chunked), layers in full_first
                       for i in range(0, len(layers), size))
        return cls(groups, size)

    @classmethod
    def single(cls, num_layers: int = 1) -> KVGroups:
        return cls((KVGroup(None, tuple(range(num_layers))),), num_layers)

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    def placement(self) -> dict[int, tuple[int, int]]:
        """layer -> (its group, the tensor pair it uses)."""
        return {layer: (g, j) for g, group in enumerate(self.groups)
                for j, layer in enumerate(group.layers)}

    def blocks_per_sequence(self, num_tokens: int, block_size: int,
                            chunk: int | None = None) -> int:
        """The most blocks one sequence of num_tokens holds at once, computed in chunks of at
        most `chunk` tokens (None: all at once)."""
        full = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += full
            else:  # the window before a chunk's first query, the chunk, one token of slack
                n = num_tokens if chunk is None else min(chunk, num_tokens)
                total += min(full, -(-(window + n) // block_size) + 1)
        return total


def layer_windows(model_cfg) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) as the model's config says;
    every layer full when it says nothing."""
    windows = getattr(model_cfg, "layer_windows", None)
    return tuple(windows) if windows else (None,) * model_cfg.num_layers


def layer_chunks(model_cfg) -> tuple[int | None, ...]:
    """Each layer's attention chunk (None: not chunked) as the model's config says."""
    chunks = getattr(model_cfg, "layer_chunks", None)
    return tuple(chunks) if chunks else (None,) * model_cfg.num_layers


def kv_groups(model_cfg) -> KVGroups:
    return KVGroups.of(layer_windows(model_cfg), layer_chunks(model_cfg))


def kv_block_bytes(model_cfg, block_size: int, elem_size: int, row_scale_bytes: int = 0) -> int:
    """Bytes of one pool block: K and V of layers_per_block layers for block_size tokens, plus
    row_scale_bytes per token and KV head (an int8 cache's scales: attention/int8_kv.py)."""
    row = model_cfg.head_dim * elem_size + row_scale_bytes
    return 2 * kv_groups(model_cfg).layers_per_block * model_cfg.num_kv_heads * row * block_size
