"""A request's images as the engine carries them: the model's processor output per image, where
its placeholder tokens sit in the prompt, and the content hash that keys both the model's encoder
cache and the prefix-cache blocks over those placeholders.

The engine does not interpret the processor output: the model's `place_images` fills `spans`
(and, for M-RoPE models, `positions`) when the request is added, and the runner hands the model
each step's `StepImages` so it can encode images and replace the placeholders' embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImageInput:
    content_hash: bytes  # of the image's pixels/bytes: two equal images share encoder output
    data: dict  # the processor's tensors for this image alone (pixel_values, image_grid_thw, ...)


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
    positions: object = None
    position_delta: int = 0

    def block_key(self, first: int, end: int) -> bytes:
        """What the prefix-cache hash of the block over tokens [first, end) mixes in: the content
        hashes of the images whose placeholders it holds (b"" for a block of text only)."""
        return b"".join(img.content_hash for img, (s, e) in zip(self.images, self.spans)
                        if s < end and e > first)


@dataclass
class StepImages:
    """One request's rows in a step: rows [row, row + count) are its tokens [first, first + count)."""
    inputs: MultiModalInputs
    row: int
    first: int
    count: int
