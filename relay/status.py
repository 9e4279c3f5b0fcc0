"""`relay status`: the relay at a glance, from its tables and its running processes.

From the tables (DataFusion through delta-rs; no Spark, no running relay needed):
  per protocol: inbox rows, pending (an envelope, not expired, not acked), the oldest pending
  envelope's age, acks, rejects by reason; landing lag in commits and seconds; bytes on disk.
  Storage (docs/operating/retention.md, delta_tables/storage.py): the live ciphertext
  (envelopes not yet delivered), the inbox rows' metadata, the bytes on disk per table, the
  storage ratio, and the oldest delivered byte still on disk: the longest an acked envelope
  has kept its bytes in the inbox, or a file the log removed has waited for VACUUM,
  whichever is older.
  PPP room messages (`ppp_room`) are never acked (they stay until their room's expiry), so
  they have no pending count or age ("-").
From each role's /metrics (`[metrics]` ports), when it answers: what that process counted
since it started. A role that does not answer is shown as `down` (or `off` with port 0).
From the lease table (delta_tables/node_lease.py), whatever host it runs on: every node that
ever held a lease, its host, pid, last heartbeat, `alive` (lease live), `dead` (expired
without a clean stop) or `stopped` (released), and its landing lag in commits. And where the
tables are (a directory, or `s3://bucket/prefix` and the endpoint; never credentials).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from urllib.parse import urlsplit

from engine.ppp.rooms import ROOM_PROTOCOL

from deltalake import DeltaTable

from delta_tables import node_lease, peer_registry, query, storage
from delta_tables.landing_lag import landing_lag
from delta_tables.layout import Layout
from delta_tables.object_store import disk_usage
from delta_tables.schema import C

from runtime import metrics
from runtime.config import Settings, process_roles


NEVER_ACKED = frozenset({ROOM_PROTOCOL})


@dataclass
class ProtocolStatus:
    inbox_rows: int = 0
    pending: int | None = 0      # None: a protocol whose rows are never acked
    oldest_pending_s: float | None = None
    live_bytes: int = 0          # ciphertext of the pending envelopes
    acks: int = 0
    rejects: dict[str, int] = field(default_factory=dict)


# The storage figures (delta_tables/storage.py holds their one definition).
StorageStatus = storage.Storage


@dataclass
class RoleStatus:
    role: str
    endpoint: str
    state: str                    # up | down | off | other (another relay's process answers)
    numbers: dict[str, object] = field(default_factory=dict)


@dataclass
class NodeStatus:
    node: str
    role: str
    host: str
    pid: int
    epoch: int                    # the lease's fencing token
    generation: int               # the landing generation it writes (or last wrote)
    heartbeat_age_s: float
    state: str                    # alive | dead (expired, no clean stop) | stopped (released)
    lag_versions: int             # its landing commits the stream has not consumed


@dataclass
class PeerStatus:
    name: str                     # the node (ingress) or host (egress) it stands for
    role: str
    host: str
    heartbeat_age_s: float
    state: str                    # alive | expired | stopped (released)


@dataclass
class Status:
    data_dir: str
    at: str
    tables_bytes: int
    protocols: dict[str, ProtocolStatus]
    landing_lag_versions: int
    landing_lag_seconds: float
    landing_tables: int
    roles: list[RoleStatus]
    storage: StorageStatus | None = None
    tables: str = ""              # where the tables are (directory or s3:// location)
    nodes: list[NodeStatus] = field(default_factory=list)
    peers: list[PeerStatus] = field(default_factory=list)   # the peer channel's registrations


def table_status(layout: Layout, now: datetime) -> dict[str, ProtocolStatus]:
    layout.ensure_shared_tables()
    inbox, acks = DeltaTable(str(layout.inbox)), DeltaTable(str(layout.acks))
    rejects = DeltaTable(str(layout.rejects))
    now_lit = f"arrow_cast('{now.isoformat()}', 'Timestamp(Microsecond, Some(\"UTC\"))')"
    out: dict[str, ProtocolStatus] = {}

    def get(p: str) -> ProtocolStatus:
        return out.setdefault(p, ProtocolStatus())

    for r in query.rows({"inbox": inbox}, f"SELECT {C.PROTOCOL} AS p, count(*) AS n "
                                          f"FROM inbox GROUP BY {C.PROTOCOL}"):
        get(r["p"]).inbox_rows = r["n"]
    for r in query.rows({"inbox": inbox, "acks": acks}, f"""
            SELECT i.{C.PROTOCOL} AS p, count(*) AS n, min(i.{C.RECEIVED_AT}) AS oldest,
                   sum({storage.byte_length('i.' + C.ENVELOPE)}) AS b
            FROM inbox i LEFT JOIN acks a
              ON a.{C.SEQ} = i.{C.SEQ} AND a.{C.PROTOCOL} = i.{C.PROTOCOL}
             AND a.{C.MAILBOX} = i.{C.MAILBOX}
            WHERE i.{C.ENVELOPE} IS NOT NULL AND i.{C.EXPIRES_AT} > {now_lit}
              AND a.{C.SEQ} IS NULL
            GROUP BY i.{C.PROTOCOL}"""):
        s = get(r["p"])
        s.live_bytes = int(r["b"] or 0)
        if r["p"] in NEVER_ACKED:
            s.pending = None
            continue
        s.pending = r["n"]
        s.oldest_pending_s = (now - r["oldest"]).total_seconds() if r["oldest"] else None
    for r in query.rows({"acks": acks}, f"SELECT {C.PROTOCOL} AS p, count(*) AS n FROM acks "
                                        f"GROUP BY {C.PROTOCOL}"):
        get(r["p"]).acks = r["n"]
    for r in query.rows({"rejects": rejects}, f"SELECT {C.PROTOCOL} AS p, {C.REASON} AS r, "
                                              f"count(*) AS n FROM rejects GROUP BY 1, 2"):
        get(r["p"]).rejects[r["r"]] = r["n"]
    return dict(sorted(out.items()))


def storage_status(layout: Layout, now: datetime,
                   protocols: dict[str, ProtocolStatus]) -> StorageStatus:
    return storage.measure(layout, now, live=sum(p.live_bytes for p in protocols.values()))


def role_status(settings: Settings, role: str, timeout: float = 1.0) -> RoleStatus:
    port = settings.metrics.port(role)
    endpoint = f"{settings.metrics.bind}:{port}"
    if port <= 0:
        return RoleStatus(role, "-", "off")
    try:
        s = metrics.scrape(f"http://{endpoint}/metrics", timeout)
    except OSError:
        return RoleStatus(role, endpoint, "down")
    # ingress_port serves `relay ingress` with every listener, or trueseal push alone
    same_port = ({"ingress", "ingress-trueseal"} if role in ("ingress", "ingress-trueseal")
                 else {role})
    if sum(metrics.total(s, "relay_process_info", role=r, data_dir=str(settings.data_path))
           for r in same_port) != 1:
        return RoleStatus(role, endpoint, "other", {})   # another relay's process answers
    n: dict[str, object] = {}
    if role.startswith("ingress"):
        n["accepted"] = metrics.by_label(s, "relay_ingress_accepted_total", "protocol")
        n["rejected"] = metrics.by_label(s, "relay_ingress_rejected_total", "reason")
        n["commit_p50_s"] = metrics.histogram_quantile(s, "relay_commit_latency_seconds", 0.5)
        n["commit_p99_s"] = metrics.histogram_quantile(s, "relay_commit_latency_seconds", 0.99)
    elif role == "egress":
        n["delivered"] = metrics.by_label(s, "relay_egress_delivered_total", "protocol")
        n["acked"] = metrics.by_label(s, "relay_egress_acked_total", "protocol")
        n["pending"] = metrics.by_label(s, "relay_egress_pending", "protocol")
        n["inbox_lag_versions"] = metrics.total(s, "relay_egress_inbox_lag_versions")
    elif role == "stream":
        n["batches"] = metrics.total(s, "relay_stream_batches_total")
        n["rows"] = metrics.total(s, "relay_stream_rows_total")
        n["accepted"] = metrics.by_label(s, "relay_stream_accepted_total", "protocol")
        n["rejected"] = metrics.by_label(s, "relay_stream_rejected_total", "reason")
        n["batch_p50_s"] = metrics.histogram_quantile(
            s, "relay_stream_batch_duration_seconds", 0.5)
        n["input_rows_per_s"] = metrics.total(s, "relay_stream_input_rows_per_second")
        n["processed_rows_per_s"] = metrics.total(s, "relay_stream_processed_rows_per_second")
    elif role == "compact":
        n["runs"] = metrics.by_label(s, "relay_compaction_runs_total", "outcome")
        n["removed"] = metrics.by_label(s, "relay_compaction_removed_total", "kind")
        n["last_run_s"] = metrics.total(s, "relay_compaction_duration_seconds")
    elif role == "push":
        n["wakeups"] = metrics.by_label(s, "relay_push_wakeups_total", "outcome")
        n["inbox_lag_versions"] = metrics.total(s, "relay_push_inbox_lag_versions")
    if role.startswith("ingress") or role == "egress":
        n["sessions"] = metrics.total(s, "relay_sessions_open")
    return RoleStatus(role, endpoint, "up", n)


def node_status(layout: Layout, lag_tables: dict[str, tuple[int, int]],
                now: datetime) -> list[NodeStatus]:
    lag: dict[str, int] = {}
    for key, (latest, done) in lag_tables.items():
        node = key.split("/")[0]
        lag[node] = lag.get(node, 0) + max(0, latest - done)
    return [NodeStatus(n.node, n.role, n.host, n.pid, n.epoch, n.generation,
                       round((now - n.heartbeat).total_seconds(), 1),
                       "stopped" if n.released else "alive" if n.live(now) else "dead",
                       lag.get(n.node, 0))
            for n in node_lease.read_all(layout.tables)]


def peer_status(layout: Layout, now: datetime) -> list[PeerStatus]:
    """The peer channel's registrations (docs/operating/peer-channel.md), without key or
    endpoint: which hosts take or give live hand-offs, and whether each still renews."""
    return [PeerStatus(p.name, p.role, p.host, round((now - p.heartbeat).total_seconds(), 1),
                       "stopped" if p.released else "alive" if p.live(now) else "expired")
            for p in peer_registry.read_all(layout.tables)]


def tables_location(settings: Settings, layout: Layout) -> str:
    """The tables' location as an operator names it; an endpoint without any user:password."""
    if layout.s3 is None:
        return str(layout.tables)
    endpoint = "AWS"
    if settings.object_store.endpoint:
        url = urlsplit(settings.object_store.endpoint)
        endpoint = f"{url.scheme}://{url.hostname}" + (f":{url.port}" if url.port else "")
    return f"{settings.tables_dir} (endpoint {endpoint})"


def collect(settings: Settings, now: datetime | None = None) -> Status:
    now = now or datetime.now(timezone.utc)
    layout = Layout.of(settings)
    lag = landing_lag(layout, settings.stream_checkpoint, now.timestamp())
    protocols = table_status(layout, now)
    return Status(
        data_dir=str(layout.root), at=now.isoformat(timespec="seconds"),
        tables_bytes=disk_usage(layout.tables), protocols=protocols,
        landing_lag_versions=lag.versions, landing_lag_seconds=round(lag.seconds, 3),
        landing_tables=len(lag.tables),
        roles=[role_status(settings, r) for r in process_roles(settings)],
        storage=storage_status(layout, now, protocols),
        tables=tables_location(settings, layout), nodes=node_status(layout, lag.tables, now),
        peers=peer_status(layout, now))


# --- printing ---------------------------------------------------------------------------------

def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _kv(d: dict) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(d.items()) if v) or "0"


def _ms(s: float | None) -> str:
    return "-" if s is None or s == float("inf") else f"<={s * 1000:g}ms"


def _role_line(r: RoleStatus) -> str:
    n = r.numbers
    if r.state != "up":
        return f"  {r.role:<16} {r.endpoint:<16} {r.state}"
    if r.role.startswith("ingress"):
        detail = (f"accepted {_kv(n['accepted'])} | rejected {_kv(n['rejected'])} | "
                  f"sessions {n['sessions']:g} | commit p50 {_ms(n['commit_p50_s'])} "
                  f"p99 {_ms(n['commit_p99_s'])}")
    elif r.role == "egress":
        detail = (f"delivered {_kv(n['delivered'])} | acked {_kv(n['acked'])} | "
                  f"pending {_kv(n['pending'])} | sessions {n['sessions']:g} | "
                  f"inbox lag {n['inbox_lag_versions']:g} commits")
    elif r.role == "stream":
        detail = (f"batches {n['batches']:g} | rows {n['rows']:g} | accepted "
                  f"{_kv(n['accepted'])} | rejected {_kv(n['rejected'])} | batch p50 "
                  f"{_ms(n['batch_p50_s'])} | in {n['input_rows_per_s']:.0f}/s "
                  f"processed {n['processed_rows_per_s']:.0f}/s")
    elif r.role == "push":
        detail = (f"wake-ups {_kv(n['wakeups'])} | "
                  f"inbox lag {n['inbox_lag_versions']:g} commits")
    else:
        detail = (f"runs {_kv(n['runs'])} | removed {_kv(n['removed'])} | "
                  f"last run {n['last_run_s']:.1f}s")
    return f"  {r.role:<16} {r.endpoint:<16} up    {detail}"


def format_status(st: Status) -> str:
    lines = [f"relay status  {st.at}  {st.data_dir}  (tables {_bytes(st.tables_bytes)})", "",
             "  protocol    inbox rows   pending  oldest pending     acks  rejects"]
    for p, s in st.protocols.items():
        pending = "-" if s.pending is None else s.pending
        lines.append(f"  {p:<10} {s.inbox_rows:>11} {pending:>9}  {_age(s.oldest_pending_s):>14} "
                     f"{s.acks:>8}  {_kv(s.rejects)}")
    if not st.protocols:
        lines.append("  (no envelopes yet)")
    if st.storage is not None:
        g = st.storage
        ratio = "-" if g.ratio is None else f"{g.ratio:.1f}x"
        lines += ["", f"  storage  live ciphertext {_bytes(g.live_bytes)} + row metadata "
                      f"{_bytes(g.row_metadata_bytes)}, on disk {_bytes(g.on_disk)} ({ratio}), "
                      f"oldest delivered byte on disk {_age(g.oldest_delivered_s)}",
                  "    " + "  ".join(f"{name} {_bytes(n)}"
                                     for name, n in g.table_bytes.items())]
    lines += ["", f"  tables  {st.tables}", "",
              f"  {'node':<20} {'role':<17} {'host':<20} {'pid':>6}  {'heartbeat':>9}  "
              f"{'state':<8} {'lag':>5}"]
    for n in st.nodes:
        lines.append(f"  {n.node:<20} {n.role:<17} {n.host[:20]:<20} {n.pid:>6}  "
                     f"{_age(n.heartbeat_age_s) + ' ago':>9}  {n.state:<8} {n.lag_versions:>5}")
    if not st.nodes:
        lines.append("  (no node has held a lease)")
    if st.peers:
        lines += ["", f"  {'peer':<20} {'role':<17} {'host':<20} {'heartbeat':>9}  state"]
        lines += [f"  {p.name:<20} {p.role:<17} {p.host[:20]:<20} "
                  f"{_age(p.heartbeat_age_s) + ' ago':>9}  {p.state}" for p in st.peers]
    lines += ["", f"  landing lag  {st.landing_lag_versions} commits, "
                  f"{st.landing_lag_seconds:.1f} s  ({st.landing_tables} landing tables)", "",
              "  role             metrics          state"]
    lines += [_role_line(r) for r in st.roles]
    return "\n".join(lines)


def to_json(st: Status) -> str:
    return json.dumps(asdict(st), default=str, indent=1)
