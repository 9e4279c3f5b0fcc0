"""Two ingress nodes, one stream (issue 18): a second ingress process stands for another host
(its own data directory, keys and node id; the same tables: a shared directory, or the S3
server with RELAY_TEST_TABLES=s3). It runs trueseal push only (Heya, PPP and cursor-sync on
two hosts: tests/test_heya_hosts.py, test_ppp_hosts.py, test_sync_hosts.py).
Both take pushes while one stream and one egress serve them; the second node is killed with
SIGKILL mid-load and never comes back. Every push either node acked is delivered, none twice
in the inbox, cursors gap-free: a dead node's landing is still read."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import pytest

from crash_harness import PushLoad, Receivers, RoleProc, free_ports, log, tables_dir
from test_crash import (ACK_DEADLINE, DELIVERY_DEADLINE, MAILBOXES, STREAM_READY_TIMEOUT,
                        WORKERS, Relay, landing_rows, read_table, wait_for)

pytestmark = pytest.mark.crash

PUSHES, LOAD_SECONDS = 800, 40.0        # per node


@pytest.fixture
def two_nodes(tmp_path, s3_endpoint):
    relay = Relay(tmp_path, s3_endpoint)
    push_port, metrics_port = free_ports(2)
    # node id node-b-trueseal: `relay ingress --protocol trueseal` appends its protocol
    env = dict(relay.env, RELAY_DATA_DIR=str(tmp_path / "data-b"), RELAY_NODE_ID="node-b",
               RELAY_TRUESEAL_PUSH_PORT=str(push_port),
               RELAY_METRICS_PORT_INGRESS=str(metrics_port))
    if not s3_endpoint:             # the other "host" shares the first one's tables directory
        env["RELAY_TABLES_DIR"] = str(tables_dir(relay.data))
    other = RoleProc("ingress-trueseal", env, relay.prefix, relay.logs,
                     command=["ingress", "--protocol", "trueseal"])
    try:
        yield relay, other, env, push_port
    finally:
        other.cleanup()
        relay.cleanup()


def test_a_dead_ingress_node_loses_nothing_it_acked(two_nodes):
    asyncio.run(_scenario(*two_nodes))


async def every_landing_row_in_the_inbox_once(data) -> None:
    """Every landing row of every node reached the inbox (or rejects), each event once,
    cursors gap-free per mailbox (waits up to a minute for the stream)."""
    deadline = time.monotonic() + 60
    while True:
        landed = len(landing_rows(data))
        inbox = read_table(tables_dir(data) / "inbox", ["event_id", "mailbox", "cursor"])
        rejects = read_table(tables_dir(data) / "rejects", ["event_id"]).num_rows
        if landed == inbox.num_rows + rejects or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    assert landed == inbox.num_rows + rejects
    ids = inbox.column("event_id").to_pylist()
    assert len(ids) == len(set(ids))
    per: dict[bytes, list[int]] = {}
    for r in inbox.to_pylist():
        per.setdefault(r["mailbox"], []).append(r["cursor"])
    assert all(sorted(c) == list(range(1, len(c) + 1)) for c in per.values())


async def _scenario(relay: Relay, other: RoleProc, env_b: dict, push_port_b: int) -> None:
    pub_a = relay.relay_pub()
    out = subprocess.run([sys.executable, "-m", "relay.cli", *relay.prefix, "keys"],
                         env=env_b, capture_output=True, text=True, check=True)
    pub_b = bytes.fromhex(dict(line.split() for line in out.stdout.splitlines()
                               if line.strip())["trueseal"])
    assert pub_a != pub_b                           # two hosts, two relay keys
    procs = relay.procs
    for role in ("ingress", "egress", "stream"):
        procs[role].start()
    other.start()
    await asyncio.gather(procs["ingress"].wait_ready(60), procs["egress"].wait_ready(60),
                         procs["stream"].wait_ready(STREAM_READY_TIMEOUT), other.wait_ready(60))
    receivers = Receivers(relay.receive_port, pub_a, MAILBOXES)
    receivers.start()
    seed = random.SystemRandom().randrange(1 << 32)
    log(f"two nodes, seed {seed}")
    load_a = PushLoad(relay.push_port, pub_a, receivers.mailboxes, PUSHES, LOAD_SECONDS,
                      WORKERS // 2, seed)
    load_b = PushLoad(push_port_b, pub_b, receivers.mailboxes, PUSHES, LOAD_SECONDS,
                      WORKERS // 2, seed + 1, first_uid=1_000_001)
    load_a.start()
    load_b.start()
    await asyncio.sleep(random.Random(seed).uniform(LOAD_SECONDS * 0.3, LOAD_SECONDS * 0.6))
    in_flight = load_b.in_flight
    other.kill9(whole_tree=True)
    await asyncio.sleep(0.5)
    acked_b = set(load_b.acked)                     # the dead node acks nothing any more
    await load_b.close()
    log(f"node-b killed with {in_flight} pushes in flight, {len(acked_b)} acked before")
    assert acked_b, "node-b acked nothing before it was killed"

    await load_a.producer_done.wait()
    assert await wait_for(lambda: load_a.unacked == 0, ACK_DEADLINE)
    await load_a.close()
    acked = set(load_a.acked) | acked_b
    ok = await wait_for(lambda: acked <= receivers.delivered_uids.keys(), DELIVERY_DEADLINE)
    undelivered = acked - receivers.delivered_uids.keys()
    await receivers.close()
    assert ok, f"{len(undelivered)} acked envelopes not delivered, e.g. {sorted(undelivered)[:10]}"
    assert any(uid > 1_000_000 for uid in receivers.delivered_uids), "nothing of node-b's"

    # both nodes' landing tables were read; the inbox holds each event once, cursors gap-free
    data = relay.data
    nodes = {p.name for p in (tables_dir(data) / "landing").iterdir() if p.is_dir()}
    assert {"node-0", "node-b-trueseal"} <= nodes
    await every_landing_row_in_the_inbox_once(data)
    for role in ("ingress", "stream", "egress"):
        assert await procs[role].term(90) == 0
    log(f"delivered {len(acked)} acked envelopes ({len(acked_b)} from the dead node)")
