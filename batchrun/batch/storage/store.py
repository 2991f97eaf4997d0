"""The job's storage options, bound once: every file operation of a run goes through one
Storage instead of threading (path, storage_options) pairs through every signature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Any

from batchrun.batch.storage import io


@dataclass(frozen=True)
class Storage:
    options: dict[str, Any] | None = None  # --storage-options (flat or keyed by protocol)

    def filesystem(self, url: str):
        return io.filesystem(url, self.options)

    def exists(self, path: str) -> bool:
        return io.exists(path, self.options)

    def size(self, path: str) -> int | None:
        return io.size(path, self.options)

    def version(self, path: str) -> str | None:
        return io.version(path, self.options)

    def expand(self, args: list[str]) -> list[str]:
        return io.expand_inputs(args, self.options)

    def open_read(self, path: str) -> IO[bytes]:
        return io.open_read(path, self.options)

    def read_json(self, path: str) -> Any:
        return io.read_json(path, self.options)

    def write_json(self, path: str, obj: dict) -> None:
        io.write_json(path, obj, self.options)

    def remove(self, path: str) -> None:
        io.remove(path, self.options)

    def __hash__(self) -> int:  # the options dict is not hashable; identity is what matters
        return id(self)


NO_OPTIONS = Storage()  # local files, and object stores with their default credentials
