"""Options of `batchrun serve`: the listener, authentication, limits and where state lives."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, field_validator

from batchrun.options.fields import option


class ServerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    SECTION: ClassVar[str] = "server"

    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(8000, "Port to listen on.", ge=0, le=65535)
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer KEY' on all routes but /health, /metrics, /version.",
        envvar="BATCHRUN_API_KEY")
    served_model_name: str | None = option(
        None, "The model name the API shows and accepts [default: the model's registry name].")
    data_dir: Path | None = option(
        None, "Where uploads, batch state and results live [default: $BATCHRUN_CACHE/server].")
    max_queued_requests: int = option(1024, "Interactive requests in flight before the API "
                                      "answers 429.", ge=1)
    max_body_size: ByteSize = option(ByteSize(16 << 20), "Largest JSON request body "
                                     "[default: 16MiB].")
    max_upload_size: ByteSize = option(ByteSize(200 << 20), "Largest file upload (OpenAI's limit "
                                       "for a batch input file) [default: 200MiB].")
    read_timeout: float = option(
        15.0, "Seconds to send a request's header, or to pause inside its body. Past it the "
        "connection is closed, so half-open and slowloris connections do not pile up.",
        gt=0, metavar="SECONDS")
    timeout_keep_alive: float = option(5.0, "Close a kept-alive connection idle this long "
                                       "between requests.", gt=0, metavar="SECONDS")
    max_connections: int | None = option(2048, "Open connections (idle ones included) past "
                                         "which requests get 503.", ge=1)
    max_concurrent_batches: int = option(1, "Batches-API jobs running at once (the rest "
                                         "queue).", ge=1)
    batch_max_in_flight: int | None = option(
        None, "Requests one batch keeps in the engine [default: what leaves an eighth of the "
        "sequence slots to interactive requests].", cli=False, ge=1)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "Log level.")

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: str | None) -> str | None:
        """Empty would switch authentication off, and surrounding whitespace can never match
        (the presented token is stripped)."""
        if key is None:
            return None
        if not key.strip():
            raise ValueError("the API key is empty, which would turn authentication off; leave "
                             "it unset to serve without a key")
        if key != key.strip():
            raise ValueError("the API key has leading or trailing whitespace, which no client's "
                             "token can match")
        return key

    @field_validator("data_dir", mode="before")
    @classmethod
    def _path(cls, value):
        return Path(value) if isinstance(value, str) else value
