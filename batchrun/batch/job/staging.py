"""Crash-safe commit of results as they complete, and the final merge into input order.

A staging folder beside the output holds `manifest.json` (what job this is: its inputs) and
committed parts `part-AAAAA-SSSSS.jsonl` (attempt, sequence). A part is written whole and then
published atomically (fsync + rename locally, one PUT on an object store), so a part that exists
is complete; anything else in the folder is scratch from a crash and is ignored (and `lock`,
left by versions that locked the folder; the output's lease now keeps one run per job).

A part's first line is a header listing its records' input positions and states, their count and the body's
sha256 (part_format.py); each record line is `POSITION STATE JSON`, sorted by position within
the part. A resume reads and verifies every part (a damaged one is discarded with a warning and
its lines run again); the merge verifies them again as it streams and publishes nothing when
one does not match.

At the end the parts are merged by position (k-way, at most FAN_IN files open, more passes when
there are more parts) into the output and error files; for a position committed twice (a retried
error) the later attempt wins.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import re
import shutil
from array import array
from dataclasses import dataclass
from typing import IO, Callable, Iterator

from batchrun.batch.job.part_format import PartDamaged, checked_records, encode_part, read_header
from batchrun.batch.storage import io
from batchrun.batch.storage.store import NO_OPTIONS, Storage
from batchrun.batch.storage.lines import split_position

# Committed states of an input line. EXPIRED: not done by the job's deadline (a batch_expired
# error line); a resume runs it again.
OK, FAILED, RETRYABLE, EXPIRED = 1, 2, 3, 4
FAN_IN = 32
_PART = re.compile(r"^part-(\d{5,})-(\d{6,})\.jsonl$")
_MANIFEST = "manifest.json"
_LOCK = "lock"
_FORMAT = 1
log = logging.getLogger("batchrun.batch")


class StagingError(ValueError):
    """The staging folder belongs to another job or is not batchrun's (a usage error)."""


class ManifestDamaged(StagingError):
    """manifest.json is not what batchrun wrote (a resume rewrites it)."""


class DamagedStagingError(RuntimeError):
    """A committed part turned out damaged while merging (exit 1; a resume reruns its lines)."""


@dataclass(slots=True)
class Record:
    pos: int
    state: int
    text: str  # the batch output or error line, JSON without newline
    digest: int = 0  # of the input line it answers (0 = unknown)


class Committed:
    """Per input line, per source: a state byte (0 = not committed) and the 8-byte digest of
    the input line the record answers (0 = unknown), ~9 bytes a line."""

    def __init__(self) -> None:
        self._by_source: dict[int, tuple[bytearray, array]] = {}
        self.count = 0

    def set(self, source: int, line: int, state: int, digest: int = 0) -> None:
        states, digests = self._by_source.setdefault(source, (bytearray(), array("Q")))
        if line >= len(states):
            grow = max(line + 1 - len(states), len(states) // 2)
            states.extend(bytes(grow))
            digests.extend(array("Q", bytes(8 * grow)))
        if not states[line]:
            self.count += 1
        states[line] = state
        digests[line] = digest

    def expired(self) -> int:
        """Lines committed as EXPIRED (a resume runs them again)."""
        return sum(states.count(EXPIRED) for states, _ in self._by_source.values())

    def get(self, source: int, line: int) -> int:
        entry = self._by_source.get(source)
        return entry[0][line] if entry is not None and line < len(entry[0]) else 0

    def changed(self, source: int, line: int, digest: int) -> bool:
        """Whether the committed line had other content (False where either digest is unknown)."""
        entry = self._by_source.get(source)
        if entry is None or line >= len(entry[0]) or not digest:
            return False
        old = entry[1][line]
        return bool(old) and old != digest


class Staging:
    def __init__(self, url: str, storage: Storage = NO_OPTIONS):
        self.url = url.rstrip("/")
        self.local = io.is_local(url)
        self.fs, self.root = storage.filesystem(self.url)
        if self.local:
            self.root = os.path.abspath(io.local_path(self.url))
        self.attempt = 1
        self._seq = 0
        self.guard: Callable[[], None] = lambda: None  # raises when this run may not write

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local else f"{self.root}/{name}"

    def _names(self) -> list[str]:
        if self.local:
            return self._local_names()
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))

    def _local_names(self) -> list[str]:
        """The folder's entries; StagingError where the folder or an entry is a symbolic link
        (a link is never followed: a --restart would delete what the folder links to)."""
        try:
            io.refuse_link(self.root)
            if not os.path.isdir(self.root):
                return []
            with os.scandir(self.root) as entries:
                found = list(entries)
        except io.LinkRefused as exc:
            raise StagingError(str(exc)) from None
        linked = next((e.path for e in found if e.is_symlink()), None)
        if linked is not None:
            raise StagingError(f"{linked} in the staging folder is a symbolic link: batchrun "
                               "does not follow links to its own files (remove it)")
        return sorted(e.name for e in found)

    def exists(self) -> bool:
        return _MANIFEST in self._names()

    def has_files(self) -> bool:
        return any(n != _LOCK for n in self._names())

    def parts(self) -> list[str]:
        """Committed parts, oldest first (attempt, then sequence)."""
        found = [(m, n) for n in self._names() if (m := _PART.match(n))]
        return [n for m, n in sorted(found, key=lambda x: (int(x[0][1]), int(x[0][2])))]

    def clear(self) -> None:
        """A fresh start."""
        self._remove([n for n in self._names() if n != _LOCK])

    # --- job identity -----------------------------------------------------------------------

    def create(self, manifest: dict) -> None:
        if self.local:
            os.makedirs(self.root, exist_ok=True)
        data = json.dumps({"batchrun_staging": _FORMAT, **manifest}, indent=1).encode()
        self._write_whole(_MANIFEST, data)

    def manifest(self) -> dict:
        with self._open(_MANIFEST) as f:
            raw = f.read()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestDamaged(f"{self._path(_MANIFEST)} is damaged (not JSON: {exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("inputs", []), list):
            raise ManifestDamaged(f"{self._path(_MANIFEST)} is damaged (not a batchrun manifest)")
        if data.get("batchrun_staging") != _FORMAT:
            raise StagingError(f"{self.url} is not a batchrun staging folder of this version")
        return data

    def check_inputs(self, inputs: list[list]) -> None:
        """Resuming is by input position, so the inputs must be the same files. Their content
        may have changed (a truncated file replaced, a line edited): each committed record keeps
        the digest of its input line, so the run notices what changed, and the merge leaves out
        positions past the end of the inputs as read."""
        try:
            old = self.manifest().get("inputs")
        except (ManifestDamaged, FileNotFoundError) as exc:
            # The parts carry each record's input-line digest: a resume can still tell what
            # changed; repair_manifest rewrites it.
            log.warning("%s; resuming by the committed parts' own line digests",
                        exc if isinstance(exc, ManifestDamaged) else
                        f"{self._path(_MANIFEST)} is missing")
            return
        if old is None or len(old) != len(inputs) or any(a[0] != b[0] for a, b in zip(old, inputs)):
            raise StagingError(
                f"{self.url} holds results of a run over other inputs ({_describe(old)}; now "
                f"{_describe(inputs)}). Use --restart to discard them or another output path.")

    def repair_manifest(self, manifest: dict) -> None:
        """Rewrite a missing or damaged manifest (resuming: check_inputs warned of it)."""
        try:
            self.manifest()
        except (ManifestDamaged, FileNotFoundError):
            self.create(manifest)

    # --- commit -----------------------------------------------------------------------------

    def scan(self) -> Committed:
        """Read and verify every committed part; start a new attempt after the last one. A
        damaged part is removed, with a warning naming it: its lines run again."""
        committed = Committed()
        last = 0
        for name in self.parts():
            match = _PART.match(name)
            assert match is not None  # parts() lists only names _PART matches
            last = max(last, int(match.group(1)))
            try:
                with self._open(name) as f:
                    header = read_header(f)
                    for _ in checked_records(f, header):
                        pass
            except PartDamaged as exc:
                self._discard(name, exc)
                continue
            digests = header.get("digests") or [0] * len(header["positions"])
            for pos, state, digest in zip(header["positions"], header["states"], digests):
                source, line = split_position(pos)
                committed.set(source, line, int(state), digest)
        self.attempt, self._seq = last + 1, 0
        return committed

    def committed_lines(self) -> int:
        """Distinct input lines with a committed record, from the part headers only (no
        verification, nothing removed: what `batchrun plan` reports)."""
        positions: set[int] = set()
        for name in self.parts():
            try:
                with self._open(name, small=True) as f:
                    positions.update(read_header(f)["positions"])
            except (PartDamaged, OSError):
                continue
        return len(positions)

    def _discard(self, name: str, why: Exception) -> None:
        log.warning("the committed part %s is damaged (%s): discarded, its lines run again",
                    self._path(name), why)
        self._remove([name])

    def commit(self, records: list[Record]) -> str | None:
        if not records:
            return None
        data = encode_part(sorted(records, key=lambda r: r.pos))
        self.guard()
        self._seq += 1
        name = f"part-{self.attempt:05d}-{self._seq:06d}.jsonl"
        self._write_whole(name, data)
        return name

    # --- merge ------------------------------------------------------------------------------

    def merge(self, write_ok: Callable[[str], None], write_error: Callable[[str], None],
              last_lines: dict[int, int] | None = None) -> dict[int, int]:
        """Stream every committed record, in input order, to write_ok / write_error; returns
        the count per state. With `last_lines` (source -> its last line, as a completed run
        read it), records of lines past a source's end (an input that shrank) are left out."""
        self.guard()
        self.clean_scratch()
        runs = self.parts()
        level = 0
        while len(runs) > FAN_IN:
            level += 1
            merged = []
            for i in range(0, len(runs), FAN_IN):
                name = f"merge-{level:02d}-{i // FAN_IN:05d}.jsonl"
                with self._create(name) as out:
                    for pos, state, text in self._merged(runs[i:i + FAN_IN]):
                        out.write(f"{pos} {state} {text}".encode("utf-8"))
                merged.append(name)
            self._remove([r for r in runs if r.startswith("merge-")])
            runs = merged
        counts = {OK: 0, FAILED: 0, RETRYABLE: 0, EXPIRED: 0}
        for pos, state, text in self._merged(runs):
            if last_lines is not None:
                source, line = split_position(pos)
                if line > last_lines.get(source, 0):
                    continue
            counts[state] += 1
            (write_ok if state == OK else write_error)(text.rstrip("\n"))
        self._remove([r for r in runs if r.startswith("merge-")])
        return counts

    def _merged(self, runs: list[str]) -> Iterator[tuple[int, int, str]]:
        """(position, state, text-with-newline) in position order, one per position: the one
        from the latest run."""
        streams = [self._open(name) for name in runs]
        try:
            iters = [self._records(f, order, name)
                     for order, (f, name) in enumerate(zip(streams, runs))]
            pending = None
            for rec in heapq.merge(*iters):
                if pending is not None and rec[0] != pending[0]:
                    yield pending[0], pending[2], pending[3]
                pending = rec
            if pending is not None:
                yield pending[0], pending[2], pending[3]
        finally:
            for f in streams:
                f.close()

    def _records(self, f: IO[bytes], order: int,
                 name: str) -> Iterator[tuple[int, int, int, str]]:
        if name.startswith("part-"):  # verified as it streams: a damaged part stops the merge
            try:
                for pos, state, text in checked_records(f, read_header(f)):
                    yield pos, order, state, text
            except PartDamaged as exc:
                self._discard(name, exc)
                raise DamagedStagingError(
                    f"the committed part {self._path(name)} was damaged ({exc}); nothing was "
                    "published: rerun with --resume (its lines run again)") from None
            return
        for raw in f:
            pos_text, state_text, text = raw.decode("utf-8").split(" ", 2)
            yield int(pos_text), order, int(state_text), text

    # --- files ------------------------------------------------------------------------------

    def _open(self, name: str, small: bool = False) -> IO[bytes]:
        if self.local:
            fd = io.open_no_follow(self._path(name), os.O_RDONLY)
            return os.fdopen(fd, "rb", buffering=1 << 16)
        return self.fs.open(self._path(name), "rb", block_size=(1 << 16) if small else (1 << 20))

    def _write_whole(self, name: str, data: bytes) -> None:
        """Visible complete or not at all: fsync + rename locally, one PUT on an object store."""
        if self.local:
            io.write_bytes_atomic(self._path(name), data)
        else:
            self.fs.pipe_file(self._path(name), data)

    def _create(self, name: str) -> IO[bytes]:
        if self.local:  # a new name: whatever is there already (a link) is not written through
            fd = io.open_no_follow(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            return os.fdopen(fd, "wb")
        return self.fs.open(self._path(name), "wb")

    def _remove(self, names: list[str]) -> None:
        for name in names:
            if self.local:
                os.remove(self._path(name))
            else:
                self.fs.rm(self._path(name))

    def clean_scratch(self) -> None:
        """Drop what a crash left half-done: temporary files and intermediate merge runs."""
        self._remove([n for n in self._names() if n.startswith(("merge-", "."))])

    def remove(self) -> None:
        if self.local:
            shutil.rmtree(self.root, ignore_errors=True)
        elif self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)


def _describe(inputs: list | None) -> str:
    if not inputs:
        return "unknown"
    names = [str(i[0]) for i in inputs]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
