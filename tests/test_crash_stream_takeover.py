"""The stream's host dies; the stream is started on another (its own data directory, the same
tables and, beside them, the same checkpoint: on the S3 server with RELAY_TEST_TABLES=s3, where
with `stream.state_store` the checkpoint is `s3a://<tables>/_checkpoints/inbox_stream`; a shared
directory otherwise). The new stream restores the state store from the checkpoint and goes on: every
acked push is delivered, the inbox holds each once, cursors gap-free."""

from __future__ import annotations

import asyncio
import random

import pytest

from crash_harness import PushLoad, Receivers, RoleProc, free_ports, log, tables_dir
from test_crash import (ACK_DEADLINE, DELIVERY_DEADLINE, MAILBOXES, STREAM_READY_TIMEOUT,
                        WORKERS, Relay, wait_for)
from test_crash_two_nodes import every_landing_row_in_the_inbox_once

pytestmark = pytest.mark.crash

PUSHES, LOAD_SECONDS = 600, 40.0


@pytest.fixture
def relay(tmp_path, s3_endpoint):
    r = Relay(tmp_path, s3_endpoint)
    try:
        yield r
    finally:
        r.cleanup()


def test_a_stream_on_another_host_takes_over_from_the_checkpoint(relay, tmp_path, s3_endpoint):
    (metrics_port,) = free_ports(1)
    # the state in Spark's state store, on both hosts
    relay.procs["stream"].env = dict(relay.env, RELAY_STREAM__STATE_STORE="true")
    env = dict(relay.env, RELAY_DATA_DIR=str(tmp_path / "data-b"),
               RELAY_METRICS_PORT_STREAM=str(metrics_port), RELAY_STREAM__STATE_STORE="true")
    if not s3_endpoint:     # a shared disk: the other host sees the first one's tables
        env["RELAY_TABLES_DIR"] = str(tables_dir(relay.data))
        env["RELAY_STREAM__CHECKPOINT_DIR"] = str(relay.data / "checkpoints" / "inbox_stream")
    other = RoleProc("stream", env, relay.prefix, relay.logs)
    try:
        asyncio.run(_scenario(relay, other))
    finally:
        other.cleanup()


async def _scenario(relay: Relay, other: RoleProc) -> None:
    pub = relay.relay_pub()
    procs = relay.procs
    for role in ("ingress", "egress", "stream"):
        procs[role].start()
    await asyncio.gather(procs["ingress"].wait_ready(60), procs["egress"].wait_ready(60),
                         procs["stream"].wait_ready(STREAM_READY_TIMEOUT))
    receivers = Receivers(relay.receive_port, pub, MAILBOXES)
    receivers.start()
    seed = random.SystemRandom().randrange(1 << 32)
    log(f"stream takeover, seed {seed}")
    load = PushLoad(relay.push_port, pub, receivers.mailboxes, PUSHES, LOAD_SECONDS, WORKERS,
                    seed)
    load.start()
    await asyncio.sleep(random.Random(seed).uniform(LOAD_SECONDS * 0.3, LOAD_SECONDS * 0.6))
    procs["stream"].kill9(whole_tree=True)        # the stream's host is gone, JVM and all
    log(f"stream killed with {len(load.acked)} pushes acked")
    await asyncio.sleep(2.0)
    other.start()                                 # ... and started on another host
    await other.wait_ready(STREAM_READY_TIMEOUT)
    await load.producer_done.wait()
    assert await wait_for(lambda: load.unacked == 0, ACK_DEADLINE)
    await load.close()
    acked = set(load.acked)
    ok = await wait_for(lambda: acked <= receivers.delivered_uids.keys(), DELIVERY_DEADLINE)
    undelivered = acked - receivers.delivered_uids.keys()
    await receivers.close()
    assert ok, f"{len(undelivered)} acked envelopes not delivered, e.g. {sorted(undelivered)[:10]}"
    await every_landing_row_in_the_inbox_once(relay.data)
    assert await other.term(90) == 0
    for role in ("ingress", "egress"):
        assert await procs[role].term(90) == 0
    log(f"delivered {len(acked)} acked envelopes across the takeover")
