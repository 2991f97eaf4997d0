"""The error line of a batch request that was not run before the batch's deadline, as OpenAI
writes it: no HTTP response, `error.code` "batch_expired"."""

from __future__ import annotations

import uuid


def expired_line(custom_id: str | None, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": "batch_expired", "message": message}}
