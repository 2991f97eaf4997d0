"""Exclusive ownership of a job's output, on every store: one lease object beside it.

`.<output name>.batchrun-lease` (hidden: input globs pass over it) is created with a
conditional write (storage/conditional.py), so of two runs started together exactly one gets
it; the other is refused before its model loads. The holder renews it every ttl/4 s (a
heartbeat thread rewriting its timestamp, again conditionally: a run that lost it learns so)
and deletes it at the end. A lease is taken over only when stale: its heartbeat older than
its TTL, or, on the same machine (boot and PID namespace), its process gone; the takeover is
logged. A lease whose values no live run writes (a NaN, infinite or future heartbeat, a TTL
outside --lease-ttl's range) is stale too, with a warning naming the value. The lease file is
never followed through a symbolic link (storage/conditional.py). A run whose lease was taken
(it stalled for longer than the TTL) stops committing and exits 1 rather than write beside the
new holder. Heartbeats compare wall clocks of different
machines: they must agree to within a fraction of the TTL (NTP does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchrun.batch.storage import io
from batchrun.batch.storage.conditional import ConditionalObject, conditional_object
from batchrun.options.job import LEASE_TTL_RANGE

log = logging.getLogger("batchrun.batch")
LEASE_SUFFIX = ".batchrun-lease"


class OutputBusyError(ValueError):
    """Another live run holds the output's lease (a usage error: nothing was run)."""


class LeaseLostError(RuntimeError):
    """This run's lease was taken over or could not be renewed: it must stop writing."""


def lease_url(output: str) -> str:
    """`s3://b/dir/out.jsonl` -> `s3://b/dir/.out.jsonl.batchrun-lease`."""
    head, sep, name = output.rpartition("/")
    return f"{head}{sep}.{name}{LEASE_SUFFIX}"


def _machine() -> str:
    """This boot of this machine and PID namespace: where a PID means the same process."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "/".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its object says."""

    owner: str
    pid: int
    host: str
    machine: str
    started: float
    heartbeat: float
    ttl: float

    @classmethod
    def parse(cls, data: bytes) -> "Holder | None":
        try:
            d = json.loads(data)
            return cls(str(d["owner"]), int(d["pid"]), str(d["host"]), str(d["machine"]),
                       float(d["started"]), float(d["heartbeat"]), float(d["ttl"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            return None

    def invalid_reason(self, now: float) -> str | None:
        """Why these values cannot come from a live batchrun run (a NaN, infinite or future
        heartbeat, a TTL outside --lease-ttl's range, no such PID), or None."""
        low, high = LEASE_TTL_RANGE
        if not math.isfinite(self.heartbeat):
            return f"its heartbeat {self.heartbeat} is not a time"
        if not (math.isfinite(self.ttl) and 0 < self.ttl <= high):
            return f"its TTL {self.ttl:g} s is outside {low:g}-{high:g} s"
        if self.heartbeat > now + max(self.ttl, low):  # more than clock skew can explain
            return f"its heartbeat is {self.heartbeat - now:.0f} s in the future"
        if not 0 < self.pid < 1 << 31:
            return f"its pid {self.pid} is not a process id"
        return None

    def stale_reason(self, ttl: float, now: float | None = None) -> str | None:
        """Why the lease may be taken over, or None while its holder is alive."""
        now = now or time.time()
        invalid = self.invalid_reason(now)
        if invalid is not None:
            return f"it is not a lease a live run keeps: {invalid}"
        age = now - self.heartbeat
        if self.machine == _machine() and not _alive(self.pid):
            return f"its process {self.pid} on this machine is gone"
        if age > max(ttl, self.ttl):
            return f"its last heartbeat was {age:.0f} s ago (TTL {max(ttl, self.ttl):.0f} s)"
        return None

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.started))
        return (f"pid {self.pid} on {self.host}, since {since}, heartbeat "
                f"{max(0.0, time.time() - self.heartbeat):.0f} s ago")


def current_holder(output: str, storage_options: dict | None = None) -> Holder | None:
    """The live holder of the output's lease, if any (read only: `batchrun plan`)."""
    found = conditional_object(lease_url(output), storage_options).read()
    if found is None:
        return None
    holder = Holder.parse(found.data)
    return holder if holder is not None and holder.stale_reason(0) is None else None


class OutputLease:
    """acquire() it before the model loads, check() before every commit, confirm() before the
    merge, release() at the end."""

    def __init__(self, output: str, storage_options: dict | None = None, ttl: float = 60.0):
        self.output, self.url, self.ttl = output, lease_url(output), ttl
        self.store: ConditionalObject = conditional_object(self.url, storage_options)
        self.owner = uuid.uuid4().hex
        self.started = time.time()
        self.token: str | None = None
        self.lost: str | None = None  # why, once lost
        self._renewed = 0.0  # time.monotonic() of the last renewal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _data(self) -> bytes:
        return json.dumps({"owner": self.owner, "pid": os.getpid(), "host": socket.gethostname(),
                           "machine": _machine(), "started": self.started,
                           "heartbeat": time.time(), "ttl": self.ttl,
                           "output": self.output}).encode()

    def acquire(self) -> "OutputLease":
        """Raises OutputBusyError while another live run holds it."""
        for _ in range(10):  # each pass loses only to a run that changed the lease meanwhile
            token = self.store.create(self._data())
            if token is None:
                found = self.store.read()
                if found is None:
                    continue  # released meanwhile
                holder = Holder.parse(found.data)
                if holder is None:
                    why: str | None = "it is not a batchrun lease (unreadable)"
                else:
                    why = holder.stale_reason(self.ttl)
                    if why is None:
                        raise OutputBusyError(
                            f"another batchrun run is writing {self.output} ({holder.describe()}; "
                            f"lease {self.url}). Wait for it to finish, or stop it; a lease "
                            f"whose heartbeat stops is taken over after {holder.ttl:.0f} s.")
                token = self.store.replace(self._data(), found.token)
                if token is None:
                    continue
                log.warning("taking over the lease on %s from %s: %s", self.output,
                            f"pid {holder.pid} on {holder.host}" if holder else self.url, why)
            self.token, self._renewed = token, time.monotonic()
            self._thread = threading.Thread(target=self._beat, name="batchrun-lease",
                                            daemon=True)
            self._thread.start()
            return self
        raise OutputBusyError(f"could not acquire the lease {self.url}: it keeps changing")

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self.renew()
            except Exception as exc:  # a store hiccup: the next beat tries again
                log.warning("could not renew the lease %s: %s", self.url, exc)
                if time.monotonic() - self._renewed > self.ttl * 0.75:
                    self._lose(f"it was not renewed for {self.ttl * 0.75:.0f} s ({exc})")
            if self.lost:
                return

    def renew(self) -> None:
        with self._lock:
            if self.lost or self.token is None:
                return
            token = self.store.replace(self._data(), self.token)
            if token is None:
                self._lose("another run took it over (this run stalled for longer than "
                           f"the {self.ttl:.0f} s TTL)")
            else:
                self.token, self._renewed = token, time.monotonic()

    def _lose(self, why: str) -> None:
        self.lost = why
        log.error("lost the lease on %s: %s; this run stops writing", self.output, why)

    def check(self) -> None:
        """Before every commit. A renewal older than half the TTL (the heartbeat thread was
        stalled with the rest of the process: a paused VM, SIGSTOP) is redone first, so a run
        that wakes up after being taken over learns it before it writes."""
        if not self.lost and time.monotonic() - self._renewed > self.ttl / 2:
            try:
                self.renew()
            except Exception as exc:  # the store is unreachable: the commit will say so
                log.warning("could not renew the lease %s: %s", self.url, exc)
        if self.lost:
            raise LeaseLostError(f"this run lost the lease on {self.output}: {self.lost}; "
                                 "another run owns it now")

    def confirm(self) -> None:
        """Renew now and check: right before the merge publishes the output."""
        self.renew()
        self.check()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self.token is not None and not self.lost:
                try:
                    self.store.delete(self.token)
                except Exception as exc:  # it goes stale; the next run takes it over
                    log.warning("could not release the lease %s: %s", self.url, exc)
            self.token = None

    def __enter__(self) -> "OutputLease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lease_for(output: str, storage: Any, ttl: float) -> OutputLease | None:
    """The lease a run on `output` must hold; None for stdout (nothing shared)."""
    if output == io.STDIO:
        return None
    return OutputLease(output, storage.options, ttl)
