"""The exceptions an engine client raises that its callers handle by type.

No torch here: the batch runner, the server and the test fake import these without loading
the engine's model code.
"""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """add_request: the prompt (plus max_tokens) does not fit the model's context length. The
    batch runner reports it as context_length_exceeded; other ValueErrors from add_request are
    refusals of an unsupported request."""


class EngineDeadError(RuntimeError):
    """An AsyncEngine (or a client of it) whose engine thread stopped: after too many failing
    steps in a row, or on shutdown. Open requests get it; new ones are refused with it."""


class QueueFullError(RuntimeError):
    """AsyncEngine.generate: the limit of interactive requests in flight is reached (HTTP 429)."""
