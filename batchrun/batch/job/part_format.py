"""The bytes of one committed staging part, and the check that they are the ones written.

A part is a header line, then one line per record, `POSITION STATE JSON`, sorted by position.
The header is the part's manifest: the records' positions, states and input-line digests (what
a resume reads), their count, and the body's byte length and sha256. A part whose body does
not match (truncated, bit-flipped, not batchrun's) is damaged: its lines run again. Parts of
versions before the checksum are checked line by line instead (positions match the header,
each record is JSON).
"""

from __future__ import annotations

import hashlib
import json
from typing import IO, Any, Iterator


class PartDamaged(ValueError):
    """A committed part is not what was written; the message says how."""


def encode_part(records: list[Any]) -> bytes:
    """`records`: staging.Record objects sorted by position."""
    body = "".join(f"{r.pos} {r.state} {r.text}\n" for r in records).encode("utf-8")
    header = {"positions": [r.pos for r in records],
              "states": "".join(str(r.state) for r in records),
              "digests": [r.digest for r in records],
              "records": len(records), "bytes": len(body),
              "sha256": hashlib.sha256(body).hexdigest()}
    return json.dumps(header).encode() + b"\n" + body


def read_header(f: IO[bytes]) -> dict:
    """The header (the stream left at the first record); PartDamaged if it is not one."""
    try:
        header = json.loads(f.readline())
        positions, states = header["positions"], header["states"]
        ok = (isinstance(positions, list) and isinstance(states, str)
              and len(positions) == len(states) and all(type(p) is int for p in positions)
              and set(states) <= {"1", "2", "3", "4"})
        digests = header.get("digests")
        ok = ok and (digests is None or (isinstance(digests, list)
                                         and len(digests) == len(positions)))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise PartDamaged("its header is not a batchrun part header")
    return header


class BodyCheck:
    """Fed the body's raw lines as they are read; done() raises PartDamaged on a mismatch."""

    def __init__(self, header: dict):
        self.header = header
        self.sha = hashlib.sha256()
        self.size = 0
        self.count = 0
        self.old_format = "sha256" not in header

    def line(self, raw: bytes) -> tuple[int, int, str]:
        """(position, state, text with newline) of one record line."""
        self.sha.update(raw)
        self.size += len(raw)
        try:
            pos, state, text = raw.decode("utf-8").split(" ", 2)
            pos_i, state_i = int(pos), int(state)
        except ValueError:
            raise PartDamaged(f"record {self.count + 1} is not `POSITION STATE JSON`") from None
        positions = self.header["positions"]
        if (self.count >= len(positions) or positions[self.count] != pos_i
                or self.header["states"][self.count] != state):
            raise PartDamaged(f"record {self.count + 1} does not match the header")
        if self.old_format:  # no checksum to lean on
            try:
                json.loads(text)
            except ValueError:
                raise PartDamaged(f"record {self.count + 1} is not JSON") from None
        self.count += 1
        return pos_i, state_i, text

    def done(self) -> None:
        h = self.header
        if self.count != len(h["positions"]) or self.count != h.get("records", self.count):
            raise PartDamaged(f"it holds {self.count} records, its header says "
                              f"{len(h['positions'])}")
        if not self.old_format and (self.size != h.get("bytes")
                                    or self.sha.hexdigest() != h["sha256"]):
            raise PartDamaged(f"its {self.size} bytes do not match the checksum of the "
                              f"{h.get('bytes')} written")


def checked_records(f: IO[bytes], header: dict) -> Iterator[tuple[int, int, str]]:
    """(position, state, text) of each record of a part whose header (read_header) was read,
    checked against it; PartDamaged (possibly after some records) when they do not match."""
    check = BodyCheck(header)
    for raw in f:
        yield check.line(raw)
    check.done()
