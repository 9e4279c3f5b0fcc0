"""Receivers on another host than ingress, under load, egress killed mid-load (the peer
channel, runtime/peer_link.py). Ingress and the stream run on host A; egress runs on host B
(its own data directory, keys and node id; the tables shared: a directory, or the S3 server
with RELAY_TEST_TABLES=s3) and gets pushes over the peer channel. Mid-load egress is killed
with SIGKILL and started again: every acked push is delivered (the inbox rows deliver what
the channel could not), and most came over the channel, before their inbox rows."""

from __future__ import annotations

import asyncio
import random

import pytest

from crash_harness import PushLoad, Receivers, RoleProc, free_ports, log, tables_dir
from test_crash import (ACK_DEADLINE, DELIVERY_DEADLINE, MAILBOXES, STREAM_READY_TIMEOUT,
                        WORKERS, Relay, wait_for)
from test_peer_hosts import wait_log

pytestmark = pytest.mark.crash

PUSHES, LOAD_SECONDS = 600, 30.0


@pytest.fixture
def hosts(tmp_path, s3_endpoint):
    relay = Relay(tmp_path, s3_endpoint)
    peer, receive, metrics = free_ports(3)
    peers = dict(RELAY_CLUSTER__PEER_REFRESH_SECONDS="0.5")
    relay.procs["ingress"].env = dict(relay.env, RELAY_CLUSTER__PEER_LISTEN="true",
                                      RELAY_CLUSTER__PEER_PORT=str(peer), **peers)
    env_b = dict(relay.env, RELAY_DATA_DIR=str(tmp_path / "data-b"), RELAY_NODE_ID="host-b",
                 RELAY_CLUSTER__PEER_DIAL="true", RELAY_TRUESEAL_RECEIVE_PORT=str(receive),
                 RELAY_METRICS_PORT_EGRESS=str(metrics), **peers)
    if not s3_endpoint:             # host B shares host A's tables directory
        env_b["RELAY_TABLES_DIR"] = str(tables_dir(relay.data))
    egress_b = RoleProc("egress", env_b, relay.prefix, relay.logs)
    egress_b.stderr_path = relay.logs / "egress-b.stderr.log"
    try:
        yield relay, egress_b, receive
    finally:
        egress_b.cleanup()
        relay.cleanup()


def test_receivers_on_another_host_get_every_acked_push_through_an_egress_kill(hosts):
    asyncio.run(_scenario(*hosts))


async def _scenario(relay: Relay, egress_b: RoleProc, receive_port: int) -> None:
    from runtime import keys
    pub_a = relay.relay_pub()
    procs = relay.procs
    procs["ingress"].start()
    procs["stream"].start()
    await asyncio.gather(procs["ingress"].wait_ready(60),
                         procs["stream"].wait_ready(STREAM_READY_TIMEOUT))
    egress_b.start()
    await egress_b.wait_ready(60)
    await wait_log(egress_b, "peer_connected")
    pub_b = keys.load_or_create(egress_b.env["RELAY_DATA_DIR"]).public
    assert pub_a != pub_b
    receivers = Receivers(receive_port, pub_b, MAILBOXES)
    receivers.start()
    await asyncio.sleep(1.0)            # the receivers' mailboxes are subscribed on host A
    seed = random.SystemRandom().randrange(1 << 32)
    log(f"peer hosts, seed {seed}")
    load = PushLoad(relay.push_port, pub_a, receivers.mailboxes, PUSHES, LOAD_SECONDS,
                    WORKERS, seed)
    load.start()
    await asyncio.sleep(random.Random(seed).uniform(LOAD_SECONDS * 0.3, LOAD_SECONDS * 0.6))
    early_before = receivers.stats.early
    egress_b.kill9()
    log(f"egress on host B killed after {len(load.acked)} acks, {early_before} early")
    await asyncio.sleep(1.0)
    egress_b.start()
    await egress_b.wait_ready(60)
    await load.producer_done.wait()
    assert await wait_for(lambda: load.unacked == 0, ACK_DEADLINE)
    await load.close()
    acked = set(load.acked)
    ok = await wait_for(lambda: acked <= receivers.delivered_uids.keys(), DELIVERY_DEADLINE)
    undelivered = acked - receivers.delivered_uids.keys()
    await receivers.close()
    assert ok, f"{len(undelivered)} acked envelopes not delivered, e.g. {sorted(undelivered)[:10]}"
    early = receivers.stats.early
    log(f"delivered {len(acked)} acked envelopes, {early} before their inbox rows")
    assert early_before > 0 and early > early_before     # the channel, before and after
    assert early >= len(acked) // 2
    for role in ("ingress", "stream"):
        assert await procs[role].term(90) == 0
    assert await egress_b.term(60) == 0
