"""A node's lease in the store: one live process per node id, whatever was copied.

`node_claim.py` binds a node id to one state directory (a token) and to one process on its
host (a `flock`). A copy of that state directory, on another host, carries the token and a
lock of its own: both would run as the node, each start a landing generation, and the stream
and compaction treat the older generation as finished while the original still writes there
(acked envelopes left unread, or a generation deleted under its writer). So the id is also
leased, in the store every host shares:

* `<tables>/_relay/leases/<node>` is a one-row Delta table: node, role, host, pid, process
  start, fencing token (`epoch`), the generation the node writes now, last heartbeat and
  expiry. Each write is an overwrite that carries the Delta app transaction
  `(LEASE_APP, epoch)`: delta-rs fails a commit when a concurrent winning commit carries a
  transaction of the same app id (as `writer_fence.py` relies on), and on S3 every commit is a
  conditional PUT. So a heartbeat that lost the race to a takeover fails, and its writer,
  re-reading, sees a larger epoch: lost.
* A process starting under the id is refused (`NodeIdTaken`, exit 2) while the row is live:
  not released and its expiry not passed, unless the row names the host lock this process
  now holds (the same lock file on the same running kernel: its holder was killed, or it
  would hold it still; `NodeClaim.lock_identity`), so a restart after a crash need not wait.
  Otherwise it takes the lease with epoch + 1.
* The holder renews every `renew_seconds`; a holder that has not renewed for `seconds`
  refuses its own landing commits (`check`), since another may hold the lease by then.
* Fencing the landing (`landing_fence`): every landing commit of the holder carries
  `(LEASE_APP, epoch)`. A new holder first commits an empty fence into the node's newest
  generation and into the one it opens, so a paused former holder's next commit in either
  fails (a winning commit with the same app id, or on a local disk a taken version whose
  commit carries a larger epoch: group_commit.py) and it stops: nothing it did not ack is
  written after the new holder started, and the stream reads a generation whole.
* Compaction keeps every generation from the one the row names on while the lease is live
  or expired by less than one lease length more (`retired_below`).

Clocks: expiry is the holder's wall clock plus `seconds`; hosts are assumed to agree within
a small part of it (NTP), and the refusal of stale commits does not depend on clocks.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pyarrow as pa

from . import object_store, query
from .node_claim import NodeIdTaken

LEASE_APP = "relay:lease"

_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema([("node", pa.string()), ("role", pa.string()), ("host", pa.string()),
                    ("pid", pa.int64()), ("started", _TS), ("epoch", pa.int64()),
                    ("generation", pa.int64()), ("heartbeat", _TS), ("expires", _TS),
                    ("released", pa.bool_()), ("lock", pa.string())])
# a heartbeat every few seconds is a commit: keep the log and the removed files short
PROPERTIES = {"delta.logRetentionDuration": "interval 1 hours", "delta.checkpointInterval": "50"}
VACUUM_EVERY = 200      # renewals between removals of the replaced rows' files


class LeaseLost(RuntimeError):
    """This process no longer holds its node's lease: it must not write."""


@dataclass(frozen=True)
class Lease:
    node: str
    role: str
    host: str
    pid: int
    started: datetime
    epoch: int
    generation: int
    heartbeat: datetime
    expires: datetime
    released: bool
    lock: str       # the holder's host lock (NodeClaim.lock_identity)

    def live(self, now: datetime) -> bool:
        return not self.released and now < self.expires

    def retired_below(self, now: datetime) -> int | None:
        """Generations below this one may be dropped (when consumed and sealed); None: any may.
        A lease expired by less than one more lease length still protects its generation."""
        margin = self.expires - self.heartbeat
        if self.released or now >= self.expires + margin:
            return None
        return self.generation


def lease_root(tables):
    """Where the leases are: `tables` is a layout's `tables` (a Path or an S3Path)."""
    return object_store.as_path(tables) / "_relay" / "leases"


def _path(tables, node: str):
    return lease_root(tables) / node


def read(tables, node: str) -> Lease | None:
    """The node's lease row, or None when it never held one."""
    from deltalake import DeltaTable
    path = _path(tables, node)
    if not (path / "_delta_log").exists():
        return None
    return _row(DeltaTable(str(path)))


def read_all(tables) -> list[Lease]:
    """Every node's lease, by node id (what `relay status` lists)."""
    root = lease_root(tables)
    if not root.exists():
        return []
    out = []
    for name in sorted(object_store.listdir(root)):
        try:
            lease = read(tables, name)
        except Exception:   # a file replaced under us by a renewal's VACUUM: read once more
            lease = read(tables, name)
        if lease is not None:
            out.append(lease)
    return out


def _row(dt) -> Lease | None:
    rows = table_rows(dt)
    return Lease(**rows[0]) if rows else None


def table_rows(dt) -> list[dict]:
    """Every row of a small table (a lease, a peer registration) as dicts, through DataFusion
    (`query.read`: a pyarrow scan can abort a short command such as `relay status` at exit)."""
    return query.read(dt).to_pylist()


def open_one_row_table(path, schema: pa.Schema, name: str):
    """The Delta table at `path`, created (with `PROPERTIES`) if it is not there yet; a
    concurrent creator's table is opened instead."""
    from deltalake import DeltaTable
    if (path / "_delta_log").exists():
        return DeltaTable(str(path))
    path.mkdir(parents=True, exist_ok=True)
    try:
        return DeltaTable.create(str(path), schema=schema, mode="error", name=name,
                                 configuration=PROPERTIES)
    except Exception:
        if (path / "_delta_log").exists():   # another process created it first
            return DeltaTable(str(path))
        raise


def _now() -> datetime:
    return datetime.now(timezone.utc)


class NodeLease:
    """This process's lease on `node` (ingress or egress), taken by `acquire`."""

    def __init__(self, tables, node: str, role: str, *, seconds: float = 15.0,
                 renew_seconds: float = 3.0):
        self.tables = tables
        self.path = _path(tables, node)
        self.node = node
        self.role = role
        self.seconds = seconds
        self.renew_seconds = renew_seconds
        self.epoch = 0
        self.generation = 0     # the landing generation written now (LandingTarget sets it)
        self.started = _now()
        self.lock = ""
        self._dt = None
        self._valid_until = 0.0     # monotonic
        self._renewals = 0

    def _table(self):
        return open_one_row_table(self.path, SCHEMA, "lease")

    def acquire(self, generation: int = 0, lock: str = "") -> "NodeLease":
        """Take the lease, or NodeIdTaken while another process holds it. `lock`: the host
        lock this process holds (NodeClaim.lock_identity); a live lease of the same lock is
        a killed predecessor's (it would hold the lock still), taken over at once."""
        from deltalake.exceptions import CommitFailedError
        self.generation = generation
        self.lock = lock
        dt = self._table()
        held = _row(dt)
        if held is not None and held.live(_now()) and not (lock and held.lock == lock):
            raise NodeIdTaken(_taken_line(held, self.node))
        self.epoch = max(held.epoch if held else 0, dt.transaction_version(LEASE_APP) or 0) + 1
        try:
            self._write(dt, released=False)
        except CommitFailedError:       # another process took it between our read and write
            from deltalake import DeltaTable
            now_held = _row(DeltaTable(str(self.path)))
            raise NodeIdTaken(_taken_line(now_held, self.node) if now_held else
                              f"node {self.node!r} was taken by another process just now") \
                from None
        self._dt = dt
        return self

    def _write(self, dt, *, released: bool) -> None:
        from deltalake import CommitProperties, Transaction, write_deltalake
        now = _now()
        t0 = time.monotonic()
        row = {"node": self.node, "role": self.role, "host": socket.gethostname(),
               "pid": os.getpid(), "started": self.started, "epoch": self.epoch,
               "generation": self.generation, "heartbeat": now,
               "expires": now + timedelta(seconds=self.seconds), "released": released,
               "lock": self.lock}
        write_deltalake(dt, pa.Table.from_pylist([row], schema=SCHEMA), mode="overwrite",
                        commit_properties=CommitProperties(
                            app_transactions=[Transaction(LEASE_APP, self.epoch)]))
        # valid from when the write started: the row's expiry is later than that
        self._valid_until = t0 + self.seconds

    def renew(self) -> None:
        """One heartbeat; LeaseLost when another process took the lease."""
        from deltalake import DeltaTable
        from deltalake.exceptions import CommitFailedError
        for _ in range(3):
            try:
                self._write(self._dt, released=False)
                break
            except CommitFailedError:
                self._dt = DeltaTable(str(self.path))
                if (self._dt.transaction_version(LEASE_APP) or 0) != self.epoch:
                    self._valid_until = 0.0
                    raise LeaseLost(f"node {self.node!r}: another process took over its lease "
                                    f"(epoch {self._dt.transaction_version(LEASE_APP)}, this "
                                    f"process held {self.epoch}); it stops writing") from None
        else:
            return
        self._renewals += 1
        if self._renewals % VACUUM_EVERY == 0:
            self._dt.vacuum(retention_hours=0, enforce_retention_duration=False,
                            dry_run=False)

    def check(self) -> None:
        """Before a landing commit: LeaseLost when the lease may have passed to another
        process (not renewed within its length)."""
        if time.monotonic() >= self._valid_until:
            raise LeaseLost(f"node {self.node!r}: lease not renewed for {self.seconds:g} s "
                            f"(the store out of reach?); it stops writing")

    def release(self) -> None:
        """Give the lease up at a clean stop: the id is free at once, not after expiry."""
        if self._dt is None or time.monotonic() >= self._valid_until:
            return
        try:
            self._write(self._dt, released=True)
        except Exception:       # lost meanwhile, or the store is gone: it expires by itself
            pass
        self._dt = None
        self._valid_until = 0.0


def _taken_line(held: Lease, node: str) -> str:
    age = (_now() - held.heartbeat).total_seconds()
    left = (held.expires - _now()).total_seconds()
    return (f"node id {node!r} is held by a running process on host {held.host} (pid "
            f"{held.pid}, last heartbeat {age:.0f} s ago, lease expires in {left:.0f} s): a "
            f"copy of a node is refused; stop that process, or give this one its own id "
            f"(ingress.node_id / RELAY_NODE_ID)")
