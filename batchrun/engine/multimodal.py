"""A request's images as the engine carries them: the model's processor output per image, where
its placeholder tokens sit in the prompt, and the content hash that keys both the model's encoder
cache and the prefix-cache blocks over those placeholders.

The engine does not interpret the processor output: the model's `place_images` fills `spans`
(and, for M-RoPE models, `positions`) when the request is added, and the runner hands the model
each step's `StepImages` so it can encode images and replace the placeholders' embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model's tensors; this module itself needs no torch
    import torch


@dataclass
class ImageInput:
    content_hash: bytes  # of the image's pixels/bytes: two equal images share encoder output
    data: dict  # the processor's tensors for this image alone (pixel_values, image_grid_thw, ...)
    # The token ids the processor wrote for a chat of this image alone: how many placeholders
    # the image takes is the processor's own count (anyres grids, tiles, feature strategies).
    expansion: tuple[int, ...] = ()

    def placeholders(self, token_id: int) -> int:
        """How many placeholder tokens (`token_id`, the model's) the processor wrote for it."""
        return self.expansion.count(token_id)


@dataclass
class MultiModalInputs:
    images: list[ImageInput]
    # (first, end) token index of each image's placeholders in the prompt, filled by the model.
    spans: list[tuple[int, int]] = field(default_factory=list)
    # Token indices of each image's placeholders (spans may hold other tokens: Idefics3's tile
    # markers), filled by the model with spans.
    placeholders: list = field(default_factory=list)
    # Rotary position ids of the prompt [k, prompt_len] for models whose positions are not the
    # token index (M-RoPE); generated token i then sits at position prompt_len + i + delta.
    positions: torch.Tensor | None = None
    position_delta: int = 0
    # Set by the model: token spans [first, end) whose tokens attend to each other both ways
    # (Gemma 3: each image's placeholders; PaliGemma: the whole prompt, its prefix), so a
    # prefill chunk must hold a span whole (chunk_end); `both_ways_key` (the span's tokens'
    # hash, where they are not all one image's) goes into the prefix-cache key of its blocks.
    both_ways: list[tuple[int, int]] = field(default_factory=list)
    both_ways_key: bytes = b""

    @property
    def bidirectional(self) -> bool:
        return bool(self.both_ways)

    def block_key(self, first: int, end: int) -> bytes:
        """What the prefix-cache hash of the block over tokens [first, end) mixes in: the content
        hashes of the images whose placeholders it holds (b"" for a block of text only)."""
        key = b"".join(img.content_hash for img, (s, e) in zip(self.images, self.spans)
                       if s < end and e > first)
        if self.both_ways_key and any(s < end and e > first for s, e in self.both_ways):
            key += self.both_ways_key
        return key


    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk of tokens [start, end) may end: `end`, or, when it would split
        an image whose tokens attend both ways, that image's first token (`start` when the
        image begins at or before `start`: the chunk must wait for a step with room for it)."""
        if not self.bidirectional:
            return end
        for first, last in self.both_ways:
            if first < end < last:
                return max(start, first)
        return end

    def visible_until(self, first: int, count: int) -> list[int]:
        """For tokens [first, first + count): the end of the image span a token sits in (it
        sees the whole image), 0 for a token outside every image (causal)."""
        out = [0] * count
        if self.bidirectional:
            for a, b in self.both_ways:
                for t in range(max(a, first), min(b, first + count)):
                    out[t - first] = b
        return out


@dataclass
class StepImages:
    """One request's rows in a step: rows [row, row + count) are its tokens [first, first + count)."""
    inputs: MultiModalInputs
    row: int
    first: int
    count: int
