"""The error of an image a request names that cannot be used."""

from __future__ import annotations


class MediaError(ValueError):
    """An image a request names cannot be used; `code` is the error record's code."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code


def too_many_bytes(max_bytes: int) -> MediaError:
    return MediaError(f"the image has more than {max_bytes} bytes (--media-max-bytes)",
                      "image_too_large")
