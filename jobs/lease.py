"""One job at a time per output location: a lease record in the output location, with a heartbeat.

    with Lease(Location("out/job1")) as lease:   # raises LeaseHeld naming the other job
        ...                                      # lease.lost: set if another job took the lease

The record `_lease.json` (hidden from Parquet readers by its `_`) holds the holder's host, pid,
start time, last heartbeat (seconds since the epoch) and a random token. The holder rewrites it
every HEARTBEAT_S seconds from a background thread and deletes it when the job ends, however it
ends. A record is stale, and taken over by the next job, when its heartbeat is older than
STALE_AFTER_S seconds, or at once when its holder ran on this host and that process is gone (a
killed driver); `take_over=True` (`aggdec run --take-over-lease`) takes over the record found,
for a holder known to be dead whose heartbeat is not old yet.

How atomic taking a lease is depends on the file system:
- local and mounted file systems: the record is written to a private name and hard-linked into
  place (os.link fails if a record exists), so of two jobs starting together exactly one wins; a
  stale record is first renamed aside (only one job's rename succeeds) and checked to be the one
  judged stale. File systems without hard links fall back to an O_EXCL create.
- object stores (s3://, gs://, ...; pyarrow.fs has no conditional write): best effort. A job
  writes its record only where none is held, reads it back after LEASE_SETTLE_S and goes on only
  if it is still its own; two jobs that start within that time of each other can both go on. The
  heartbeat then finds the record overwritten and the job whose record was overwritten stops with
  a message naming the other (`lease.lost`), within HEARTBEAT_S.
Staleness compares the record's time with this host's clock: clocks must agree to well within
STALE_AFTER_S.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from jobs.spec import SpecError
from jobs.storage import Location

LEASE_NAME = "_lease.json"
HEARTBEAT_S = 10.0
"""The holder rewrites its record this often."""
STALE_AFTER_S = 60.0
"""A record whose heartbeat is older than this is stale: its job is taken to be gone."""
LEASE_SETTLE_S = 1.0
"""Object stores: how long a job waits before reading its record back."""


class LeaseHeld(SpecError):
    """The output location is held by another job (the message names it and how to take over)."""


@dataclass(frozen=True)
class Holder:
    """What a lease record says about the job holding it."""

    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    token: str

    def describe(self, now: float | None = None) -> str:
        age = (now if now is not None else time.time()) - self.heartbeat_at
        return (f"pid {self.pid} on {self.host}, started {_iso(self.started_at)}, "
                f"last heartbeat {max(age, 0):.0f} s ago")

    def stale(self, now: float | None = None) -> bool:
        """Heartbeat older than STALE_AFTER_S, or a holder on this host whose process is gone."""
        if (now if now is not None else time.time()) - self.heartbeat_at > STALE_AFTER_S:
            return True
        return self.host == socket.gethostname() and not _pid_alive(self.pid)


def read_holder(loc: Location) -> Holder | None:
    """The holder of `loc`'s lease, or None where there is no record. A record that cannot be parsed
    (being written, damaged) is reported as an unknown holder whose heartbeat is the file's age."""
    try:
        data = loc.read_bytes(LEASE_NAME)
    except FileNotFoundError:
        return None
    holder = _parse(data)
    if holder is None:
        mtime = loc.fs.get_file_info(loc.path(LEASE_NAME)).mtime
        at = mtime.timestamp() if mtime is not None else time.time()
        return Holder(host="?", pid=-1, started_at=at, heartbeat_at=at, token="")
    return holder


def held_message(loc: Location, holder: Holder) -> str:
    """One line naming the job that holds `loc` and how to take over its lease."""
    return (f"output.dir: {loc.uri} is in use by another job ({holder.describe()}); one job at a time per "
            f"output location. If that job is gone, its lease ({loc.uri_of(LEASE_NAME)}) is taken over once "
            f"its heartbeat is {STALE_AFTER_S:.0f} s old, or now with --take-over-lease")


def takeover_note(holder: Holder, forced: bool) -> str:
    """The note that this job takes over `holder`'s lease (`forced`: with --take-over-lease, else a stale one)."""
    return f"note: output.dir: taking over the lease of {'another' if forced else 'a stale'} job ({holder.describe()})"


class Lease:
    """This job's lease on `loc`: `acquire()` (or `with`) takes it, a heartbeat thread keeps it,
    `release()` deletes the record if it is still this job's."""

    def __init__(self, loc: Location, *, take_over: bool = False):
        self.loc = loc
        self.take_over = take_over
        now = time.time()
        self.me = Holder(host=socket.gethostname(), pid=os.getpid(), started_at=now, heartbeat_at=now,
                         token=uuid.uuid4().hex)
        self.taken_over: Holder | None = None  # the stale holder this job replaced, if any
        self.lost: str | None = None  # set by the heartbeat when another job holds the record
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease and start the heartbeat; raises LeaseHeld naming the holder."""
        self.loc.makedirs()
        for attempt in range(5):  # a takeover raced with another job's: look again
            holder = read_holder(self.loc)
            if holder is not None and not ((self.take_over and attempt == 0) or holder.stale()):
                raise LeaseHeld(held_message(self.loc, holder))
            if holder is not None and not self._remove(holder):
                continue
            if self._create():
                self.taken_over = holder
                break
        else:
            holder = read_holder(self.loc)
            raise LeaseHeld(held_message(self.loc, holder) if holder else
                            f"output.dir: {self.loc.uri}: could not take the lease ({LEASE_NAME})")
        self._thread = threading.Thread(target=self._beat, name="aggdec-lease-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat; delete the record if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = read_holder(self.loc)
        if holder is not None and holder.token == self.me.token:
            self.loc.delete(LEASE_NAME)

    def _record(self) -> bytes:
        return (json.dumps(asdict(self.me), indent=2) + "\n").encode("utf-8")

    def _create(self) -> bool:
        """Write this job's record where there is none. -> whether this job now holds the lease."""
        if not self.loc.local:
            if read_holder(self.loc) is not None:
                return False
            self.loc.write_bytes(LEASE_NAME, self._record())
            time.sleep(LEASE_SETTLE_S)
            holder = read_holder(self.loc)
            return holder is not None and holder.token == self.me.token
        private = self.loc.path(f"{LEASE_NAME}.{self.me.token}")
        with open(private, "wb") as f:
            f.write(self._record())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(private, self.loc.path(LEASE_NAME))
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: an exclusive create (a reader may see it half written)
            try:
                fd = os.open(self.loc.path(LEASE_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(self._record())
            return True
        finally:
            os.unlink(private)

    def _remove(self, stale: Holder) -> bool:
        """Remove the record of `stale`. -> False where another job changed the record meanwhile."""
        if not self.loc.local:
            self.loc.delete(LEASE_NAME)
            return True
        aside = self.loc.path(f"{LEASE_NAME}.{self.me.token}.old")
        try:
            os.rename(self.loc.path(LEASE_NAME), aside)
        except FileNotFoundError:  # another job moved it first
            return False
        moved = _holder_at(aside)
        if moved is not None and moved.token != stale.token:  # a fresh record replaced the stale one: put it back
            try:
                os.link(aside, self.loc.path(LEASE_NAME))
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder = read_holder(self.loc)
                if holder is None or holder.token != self.me.token:
                    self.lost = (f"output.dir: {self.loc.uri}: this job's lease was taken over by another job"
                                 + (f" ({holder.describe()})" if holder else "")
                                 + "; stopped so that two jobs do not write the same output")
                    return
                self.me = Holder(**{**asdict(self.me), "heartbeat_at": time.time()})
                self.loc.write_bytes(LEASE_NAME, self._record())
            except OSError:  # the file system failed this once: the next beat tries again
                continue


def _parse(data: bytes) -> Holder | None:
    """The holder a record names, None where it cannot be parsed."""
    try:
        rec = json.loads(data)
        return Holder(host=str(rec["host"]), pid=int(rec["pid"]), started_at=float(rec["started_at"]),
                      heartbeat_at=float(rec["heartbeat_at"]), token=str(rec["token"]))
    except (ValueError, KeyError, TypeError):
        return None


def _holder_at(path: str) -> Holder | None:
    try:
        with open(path, "rb") as f:
            return _parse(f.read())
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown: judged by the heartbeat alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
