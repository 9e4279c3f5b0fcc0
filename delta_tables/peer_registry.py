"""Who may speak on the peer channel: each host's peer key and endpoint, listed in the store.

`<tables>/_relay/peers/<name>` is a one-row Delta table per process that takes part in the
host-to-host channel (engine/peer_channel.py): its name (an ingress node id, or
`<node_id>-egress`), role, the public half of its peer key (the private half never leaves
its data dir, runtime/keys.py), the endpoint other hosts dial (`host:port`, empty for an
egress that only dials), the node lease epoch it runs under (ingress; 0 for egress) and a
heartbeat with an expiry, renewed like the lease (node_lease.py), and the protocols whose
hand-offs it takes part in (comma-separated: a listener sends those, a dialler subscribes
those; a row written before the column existed is trueseal's). A registration is live
while it is not released, its expiry has not passed and, for an ingress node, the node's
lease is live with the same epoch: a node whose lease expired or was taken over is no
longer a peer, whatever its own row says. Every host reads the same rows, so a peer is
accepted exactly when the store lists it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pyarrow as pa

from . import node_lease, object_store

_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema([("name", pa.string()), ("role", pa.string()), ("host", pa.string()),
                    ("key", pa.binary()), ("endpoint", pa.string()), ("epoch", pa.int64()),
                    ("heartbeat", _TS), ("expires", _TS), ("released", pa.bool_()),
                    ("protocols", pa.string())])
VACUUM_EVERY = node_lease.VACUUM_EVERY


@dataclass(frozen=True)
class Peer:
    name: str
    role: str
    host: str
    key: bytes
    endpoint: str
    epoch: int
    heartbeat: datetime
    expires: datetime
    released: bool
    protocols: str | None = None    # None: a row from before the column, trueseal's

    def __repr__(self) -> str:      # no key, no endpoint
        return f"Peer({self.name}, role={self.role})"

    def live(self, now: datetime) -> bool:
        return not self.released and now < self.expires

    def serves(self, protocol: str) -> bool:
        return protocol in (self.protocols or "trueseal").split(",")


def peers_root(tables):
    return object_store.as_path(tables) / "_relay" / "peers"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def read_all(tables) -> list[Peer]:
    """Every registration in the store, live or not."""
    from deltalake import DeltaTable
    root = peers_root(tables)
    if not root.exists():
        return []
    out = []
    for name in sorted(object_store.listdir(root)):
        path = root / name
        if not (path / "_delta_log").exists():
            continue
        try:
            rows = node_lease.table_rows(DeltaTable(str(path)))
        except Exception:       # a file replaced under us by a renewal's VACUUM: once more
            rows = node_lease.table_rows(DeltaTable(str(path)))
        out.extend(Peer(**r) for r in rows)
    return out


def live(tables, now: datetime | None = None) -> list[Peer]:
    """The registrations a host may talk to now (see the module docstring)."""
    now = _now() if now is None else now
    peers = [p for p in read_all(tables) if p.live(now)]
    if not any(p.epoch for p in peers):
        return peers
    leases = {lease.node: lease for lease in node_lease.read_all(tables)}
    out = []
    for p in peers:
        lease = leases.get(p.name)
        if p.epoch == 0 or (lease is not None and lease.epoch == p.epoch and lease.live(now)):
            out.append(p)
    return out


class PeerRegistration:
    """This process's row: `register`, then `renew` every few seconds, `release` at a stop."""

    def __init__(self, tables, name: str, role: str, key: bytes, endpoint: str = "", *,
                 epoch: int = 0, seconds: float = 15.0, protocols=("trueseal",)):
        self.path = peers_root(tables) / name
        self.name = name
        self.role = role
        self.key = bytes(key)
        self.endpoint = endpoint
        self.epoch = epoch
        self.seconds = seconds
        self.protocols = ",".join(sorted(protocols))
        self._dt = None
        self._renewals = 0

    def _write(self, *, released: bool) -> None:
        from deltalake import write_deltalake
        now = _now()
        row = {"name": self.name, "role": self.role, "host": socket.gethostname(),
               "key": self.key, "endpoint": self.endpoint, "epoch": self.epoch,
               "heartbeat": now, "expires": now + timedelta(seconds=self.seconds),
               "released": released, "protocols": self.protocols}
        # schema_mode: a row table made before the protocols column takes it at its next write
        write_deltalake(self._dt, pa.Table.from_pylist([row], schema=SCHEMA), mode="overwrite",
                        schema_mode="overwrite")

    def register(self) -> "PeerRegistration":
        self._dt = node_lease.open_one_row_table(self.path, SCHEMA, "peer")
        self._write(released=False)
        return self

    def renew(self) -> None:
        from deltalake import DeltaTable
        try:
            self._write(released=False)
        except Exception:   # one writer per name: a stale handle, read again and retry once
            self._dt = DeltaTable(str(self.path))
            self._write(released=False)
        self._renewals += 1
        if self._renewals % VACUUM_EVERY == 0:
            self._dt.vacuum(retention_hours=0, enforce_retention_duration=False,
                            dry_run=False)

    def release(self) -> None:
        if self._dt is None:
            return
        try:
            self._write(released=True)
        except Exception:   # the store out of reach: the row expires by itself
            pass
        self._dt = None


class PeerStore:
    """The store as the peer channel sees it (runtime/peer_link.PeerStore): the live
    registrations of `tables`, and a registration of this process's own there."""

    def __init__(self, tables):
        self.tables = tables

    def live(self) -> list[Peer]:
        return live(self.tables)

    def registration(self, name: str, role: str, key: bytes, endpoint: str = "",
                     **kw) -> PeerRegistration:
        return PeerRegistration(self.tables, name, role, key, endpoint, **kw)
