"""A node id is leased in the store (delta_tables/node_lease.py): one live process per id on
every host sharing the tables, a takeover only after expiry, the former holder fenced out of
the landing, and compaction keeps the generation a live node writes. Real Delta tables (a
temporary directory, or the S3 server with RELAY_TEST_TABLES=s3)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from crash_harness import RoleProc, free_ports
from delta_tables import node_lease
from delta_tables.layout import Layout
from delta_tables.group_commit import LandingTarget
from delta_tables.node_claim import NodeIdTaken
from delta_tables.node_lease import LeaseLost, NodeLease
from delta_tables.schema import LANDING
from jobs.compact import drop_consumed_landing
from landing_rows import envelope, landing_row
from relay.bench.s3_server import BUCKET, CREDENTIALS

LEASE = 1.0     # seconds: short, so that a test waits for expiry


def rows(*ns: int) -> pa.Table:
    return pa.Table.from_pylist([landing_row(b"m" * 32, envelope(n)) for n in ns],
                                schema=LANDING.arrow_schema())


def landed(target_or_layout, node: str) -> list[int]:
    """Every envelope number in the node's landing generations."""
    layout = target_or_layout
    out = []
    for gen in layout.generations(node):
        t = DeltaTable(str(layout.landing_generation(node, gen))).to_pyarrow_table()
        out += [int.from_bytes(e[:8], "big") for e in t.column("envelope").to_pylist()]
    return sorted(out)


def test_a_live_lease_refuses_a_second_holder_and_expires(layout):
    first = NodeLease(layout.tables, "node-1", "ingress", seconds=LEASE).acquire()
    with pytest.raises(NodeIdTaken, match="held by a running process on host"):
        NodeLease(layout.tables, "node-1", "ingress", seconds=LEASE).acquire()
    first.renew()
    other = NodeLease(layout.tables, "node-2", "ingress", seconds=LEASE).acquire()  # own id
    time.sleep(LEASE + 0.2)                         # the first stops renewing: expired
    with pytest.raises(LeaseLost):
        first.check()                               # it refuses its own writes by itself
    second = NodeLease(layout.tables, "node-1", "ingress", seconds=LEASE).acquire()
    assert second.epoch == first.epoch + 1
    with pytest.raises(LeaseLost, match="took over"):
        first.renew()                               # the late heartbeat loses to the takeover
    second.renew()
    second.release()                                # a clean stop frees the id at once
    third = NodeLease(layout.tables, "node-1", "ingress", seconds=LEASE).acquire()
    assert third.epoch == second.epoch + 1
    leases = {lease.node: lease for lease in node_lease.read_all(layout.tables)}
    assert set(leases) == {"node-1", "node-2"} and leases["node-1"].epoch == third.epoch
    assert leases["node-1"].live(datetime.now(timezone.utc))
    other.release()


def test_a_former_holder_is_fenced_out_of_the_landing(layout):
    """A holder paused past its lease (its check passed just before the pause) finds its
    landing fenced by the new holder: its commit fails in its generation, and it cannot
    open the new one; and every row either acked is in a generation the stream reads whole."""
    lease_a = NodeLease(layout.tables, "node-f", "ingress", seconds=LEASE).acquire()
    a = LandingTarget(layout, "node-f", fsync=False, lease=lease_a)
    a.commit(rows(1, 2))
    gen_a = a.generation
    time.sleep(LEASE + 0.2)
    lease_b = NodeLease(layout.tables, "node-f", "ingress", seconds=30).acquire()
    b = LandingTarget(layout, "node-f", fsync=False, lease=lease_b)
    assert b.generation == gen_a + 1
    b.commit(rows(3))
    lease_a._valid_until = time.monotonic() + 60    # as if it had resumed within its lease
    with pytest.raises(LeaseLost, match="fenced"):
        a.commit(rows(4))
    with pytest.raises(LeaseLost, match="fenced"):  # ... or rotated into b's generation:
        a._target = a._target_of(b.generation)      # refused on opening (local disk)
        a.commit(rows(5))                           # or on committing (S3)
    b.commit(rows(6))
    assert landed(layout, "node-f") == [1, 2, 3, 6]
    # the fence is an empty commit that carries the new token, in both generations
    for gen in (gen_a, b.generation):
        dt = DeltaTable(str(layout.landing_generation("node-f", gen)))
        assert dt.transaction_version(node_lease.LEASE_APP) == lease_b.epoch


def test_compaction_keeps_the_generation_a_live_node_writes(layout):
    """A generation that is sealed (a newer one exists) and consumed is still kept while the
    node's lease names it, and dropped once the lease is released."""
    lease = NodeLease(layout.tables, "node-c", "ingress", seconds=30).acquire()
    a = LandingTarget(layout, "node-c", fsync=False, lease=lease)
    a.commit(rows(1))
    layout.ensure_landing("node-c", a.generation + 1)   # a newer generation appears (a copy)
    consumed = {f"node-c/g{g:06d}": 10 for g in layout.generations("node-c")}
    layout.write_landing_consumed(consumed)
    lease.renew()
    assert node_lease.read(layout.tables, "node-c").generation == a.generation
    assert drop_consumed_landing(layout) == 0
    assert a.generation in layout.generations("node-c")
    a.commit(rows(2))                                   # still written, and still there
    lease.release()
    assert drop_consumed_landing(layout) == 1
    assert layout.generations("node-c") == [a.generation + 1]


def test_an_expired_lease_protects_its_generation_one_more_lease_length():
    now = datetime.now(timezone.utc)
    lease = node_lease.Lease("n", "ingress", "h", 1, now, 3, 7, now - timedelta(seconds=20),
                             now - timedelta(seconds=5), False, "")  # 15 s lease, 5 s ago
    assert not lease.live(now) and lease.retired_below(now) == 7
    assert lease.retired_below(now + timedelta(seconds=11)) is None


@pytest.fixture(scope="module")
def s3():
    from relay.bench.s3_server import s3_server
    with s3_server() as endpoint:
        yield endpoint


def test_status_from_another_host_lists_every_node_and_the_tables(tmp_path, s3):
    """`relay status` run with another data directory (another host) lists the nodes of the
    shared tables on S3 from their leases: alive, dead (expired without a clean stop),
    stopped (released); and where the tables are, without the credentials."""

    uri = f"s3://{BUCKET}/{tmp_path.name}"
    tables = Layout.at(tmp_path / "host-a", uri, s3).tables
    alive = NodeLease(tables, "node-a", "ingress-heya", seconds=30).acquire()
    NodeLease(tables, "node-dead", "ingress-trueseal", seconds=LEASE).acquire()   # never renewed
    NodeLease(tables, "node-gone", "ingress-ppp", seconds=30).acquire().release()
    time.sleep(LEASE + 0.2)
    alive.renew()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    env.update(CREDENTIALS, RELAY_TABLES_DIR=uri, RELAY_S3_ENDPOINT=s3, NO_COLOR="1",
               RELAY_DATA_DIR=str(tmp_path / "host-b"))
    for var in [k for k in env if k.startswith("RELAY_METRICS_PORT")]:
        env.pop(var)
    text = subprocess.run([sys.executable, "-m", "relay", "status"], env=env, text=True,
                          capture_output=True, timeout=120, check=True).stdout
    st = json.loads(subprocess.run([sys.executable, "-m", "relay", "status", "--json"],
                                   env=env, text=True, capture_output=True, timeout=120,
                                   check=True).stdout)
    nodes = {n["node"]: n for n in st["nodes"]}
    assert {k: n["state"] for k, n in nodes.items()} == {
        "node-a": "alive", "node-dead": "dead", "node-gone": "stopped"}
    assert nodes["node-a"]["heartbeat_age_s"] < nodes["node-dead"]["heartbeat_age_s"]
    assert nodes["node-a"]["pid"] == os.getpid() and nodes["node-a"]["role"] == "ingress-heya"
    assert f"tables  {uri} (endpoint {s3})" in text
    for name, state in (("node-a", "alive"), ("node-dead", "dead"), ("node-gone", "stopped")):
        assert any(ln.split()[:1] == [name] and f" {state} " in ln for ln in text.splitlines())
    for secret in CREDENTIALS.values():
        assert secret not in text and secret not in json.dumps(st)
    alive.release()


def test_relay_up_on_a_copy_of_a_running_host_stops_with_the_refusal(tmp_path):
    """`relay up` whose node id another live process holds (a copied data directory, tables
    shared): its ingress process is refused, and up stops with exit 2 instead of
    restarting it."""

    tables = tmp_path / "shared-tables"
    holder = NodeLease(Layout(tmp_path / "original", tables).tables, "node-0-trueseal",
                       "ingress-trueseal", seconds=120).acquire()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    env.update(NO_COLOR="1", RELAY_LOG_FORMAT="text", RELAY_TABLES_DIR=str(tables),
               RELAY_DATA_DIR=str(tmp_path / "copy"), RELAY_INGRESS__PROCESS_PER_PROTOCOL="true",
               **{f"RELAY_METRICS_PORT_{r}": "0" for r in ("INGRESS", "EGRESS", "STREAM",
                                                           "COMPACT", "PUSH")},
               **{v: "0" for v in ("RELAY_TRUESEAL_PUSH_PORT", "RELAY_TRUESEAL_RECEIVE_PORT",
                                   "RELAY_PPP_PORT", "RELAY_HEYA_PORT", "RELAY_SYNC_PORT",
                                   "RELAY_SYNC_IROH_PORT")})
    p = subprocess.run([sys.executable, "-m", "relay", "up"], env=env, text=True,
                       capture_output=True, timeout=300)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    refusals = [ln for ln in p.stderr.splitlines() if "held by a running process" in ln]
    assert len(refusals) == 1 and f"pid {os.getpid()}" in refusals[0], p.stderr[-3000:]
    assert "ingress-trueseal exited with 2: its configuration must change" in p.stdout
    assert "restarting" not in p.stdout and "Traceback" not in p.stderr
    holder.release()


def test_a_restart_after_sigkill_in_the_same_data_directory_takes_over_at_once(tmp_path):
    """The killed process's lease is live for seconds more, but it names the host lock the
    restarted process now holds (same lock file, same running kernel): no wait, next token.
    A copy of that directory is still refused (another lock file)."""

    push, metrics = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    env.update(RELAY_DATA_DIR=str(tmp_path / "data"), RELAY_TABLES_DIR=str(tmp_path / "tables"),
               RELAY_TRUESEAL_PUSH_PORT=str(push), RELAY_METRICS_PORT_INGRESS=str(metrics),
               RELAY_INGRESS__LEASE_SECONDS="120", RELAY_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
    (tmp_path / "logs").mkdir()
    node = RoleProc("ingress-trueseal", env, [], tmp_path / "logs",
                    command=["ingress", "--protocol", "trueseal"])
    try:
        asyncio.run(node.wait_ready(60) if node.start() is None else None)
        first = node_lease.read(tmp_path / "tables", "node-0-trueseal")
        node.kill9()
        assert first.live(datetime.now(timezone.utc))       # 120 s to go
        node.start()
        asyncio.run(node.wait_ready(60))
        second = node_lease.read(tmp_path / "tables", "node-0-trueseal")
        assert second.epoch == first.epoch + 1 and second.pid == node.proc.pid
        assert second.lock == first.lock
        shutil.copytree(tmp_path / "data", tmp_path / "copy",
                        ignore=lambda d, names: [n for n in names if n.endswith(".sock")])
        with pytest.raises(NodeIdTaken, match="held by a running process"):
            NodeLease(tmp_path / "tables", "node-0-trueseal", "ingress-trueseal").acquire(
                0, lock=_lock_of(tmp_path / "copy"))
    finally:
        node.cleanup()


def _lock_of(data) -> str:
    from delta_tables.node_claim import NodeClaim
    claim = NodeClaim(data / "tables" / "landing", data / "state", "node-0-trueseal").acquire()
    try:
        return claim.lock_identity()
    finally:
        claim.release()


def test_a_copy_on_another_network_host_is_refused_then_takes_over(tmp_path):
    """The copy runs on a host of its own: a network namespace and a hostname of its own
    (`ip netns`, `unshare --uts`), the tables shared. Refused while the original runs, named
    by the original's host; after the original's SIGKILL and its lease's expiry it takes the
    node over, and `relay status` names the new host."""

    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    ns = f"relaylease{os.getpid()}"
    tables = tmp_path / "tables"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    env.update(RELAY_TABLES_DIR=str(tables), RELAY_INGRESS__LEASE_SECONDS="3",
               RELAY_INGRESS__LEASE_RENEW_SECONDS="1", RELAY_LOG_FORMAT="json",
               PYTHONUNBUFFERED="1")
    push, metrics = free_ports(2)
    original_env = dict(env, RELAY_DATA_DIR=str(tmp_path / "a"),
                        RELAY_TRUESEAL_PUSH_PORT=str(push), RELAY_METRICS_PORT_INGRESS=str(metrics))
    (tmp_path / "logs").mkdir()
    original = RoleProc("ingress-trueseal", original_env, [], tmp_path / "logs",
                        command=["ingress", "--protocol", "trueseal"])
    copy_env = dict(env, RELAY_DATA_DIR=str(tmp_path / "b"), RELAY_TRUESEAL_PUSH_PORT="0",
                    RELAY_METRICS_PORT_INGRESS="0")
    on_host_b = ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c",
                 'hostname host-b && exec "$0" "$@"', sys.executable, "-m", "relay.cli",
                 "ingress", "--protocol", "trueseal"]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    copy = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        original.start()
        asyncio.run(original.wait_ready(60))
        shutil.copytree(tmp_path / "a", tmp_path / "b",
                        ignore=lambda d, names: [n for n in names if n.endswith(".sock")])
        refused = subprocess.run(on_host_b, env=copy_env, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2, refused.stderr[-2000:]
        line = [ln for ln in refused.stderr.splitlines() if "held by a running process" in ln]
        assert len(line) == 1 and f"on host {os.uname().nodename} " in line[0]
        assert "Traceback" not in refused.stderr
        original.kill9()
        time.sleep(3.5)                                 # the dead original's lease expires
        copy = subprocess.Popen(on_host_b, env=copy_env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert select.select([copy.stdout], [], [], 60)[0], "the copy said nothing in 60 s"
        assert '"ready"' in copy.stdout.readline()      # its first line says it serves
        lease = node_lease.read(tables, "node-0-trueseal")
        assert lease.host == "host-b" and lease.live(datetime.now(timezone.utc))
        status = subprocess.run([sys.executable, "-m", "relay", "status", "--json"],
                                env=dict(env, RELAY_DATA_DIR=str(tmp_path / "c")),
                                capture_output=True, text=True, timeout=120, check=True)
        nodes = json.loads(status.stdout)["nodes"]
        assert [(n["node"], n["host"], n["state"]) for n in nodes] == [
            ("node-0-trueseal", "host-b", "alive")]
    finally:
        if copy is not None:
            copy.terminate()
            copy.wait(30)
        original.cleanup()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
