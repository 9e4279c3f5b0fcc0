"""A copy of an ingress host's data directory (its keys, node token and node id) is refused
while the original runs, and may take over only after the original died and its lease
expired (delta_tables/node_lease.py). Real processes: one relay (ingress, egress, stream),
a second ingress host `node-b` on its own data directory, and its copy, all on the same
tables (a shared directory, or the S3 server with RELAY_TEST_TABLES=s3). The original is
killed with SIGKILL mid-load; everything it acked, and everything the copy acked after it,
reaches the inbox once through the stream and is delivered."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import stat
import subprocess
import sys
import time

import pytest

from crash_harness import PushLoad, Receivers, RoleProc, free_ports, log, tables_dir
from delta_tables import node_lease
from test_crash import (ACK_DEADLINE, DELIVERY_DEADLINE, MAILBOXES, STREAM_READY_TIMEOUT,
                        WORKERS, Relay, wait_for)
from test_crash_two_nodes import every_landing_row_in_the_inbox_once

pytestmark = pytest.mark.crash

PUSHES, LOAD_SECONDS = 400, 20.0
LEASE_SECONDS = 12       # longer than a start of `relay ingress` on a busy machine
NODE = "node-b-trueseal"        # `relay ingress --protocol trueseal` appends its protocol


def _host_env(relay: Relay, data, lease_env: dict) -> tuple[dict, int]:
    push_port, metrics_port = free_ports(2)
    env = dict(relay.env, RELAY_DATA_DIR=str(data), RELAY_NODE_ID="node-b",
               RELAY_TRUESEAL_PUSH_PORT=str(push_port),
               RELAY_METRICS_PORT_INGRESS=str(metrics_port), **lease_env)
    if "RELAY_TABLES_DIR" not in relay.env:     # the hosts share the first one's tables
        env["RELAY_TABLES_DIR"] = str(tables_dir(relay.data))
    return env, push_port


def _copy_data_dir(src, dst) -> None:
    """What an operator's copy of a host takes: every regular file (not its sockets)."""
    def sockets(d, names):
        return [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(d, n)).st_mode)]
    shutil.copytree(src, dst, ignore=sockets)


@pytest.fixture
def hosts(tmp_path, s3_endpoint):
    relay = Relay(tmp_path, s3_endpoint)
    lease_env = dict(RELAY_INGRESS__LEASE_SECONDS=str(LEASE_SECONDS),
                     RELAY_INGRESS__LEASE_RENEW_SECONDS="2")
    env_b, port_b = _host_env(relay, tmp_path / "data-b", lease_env)
    env_c, port_c = _host_env(relay, tmp_path / "data-c", lease_env)
    (tmp_path / "logs-c").mkdir()
    cmd = ["ingress", "--protocol", "trueseal"]
    original = RoleProc("ingress-trueseal", env_b, relay.prefix, relay.logs, command=cmd)
    clone = RoleProc("ingress-trueseal", env_c, relay.prefix, tmp_path / "logs-c", command=cmd)
    try:
        yield relay, original, clone, port_b, port_c
    finally:
        clone.cleanup()
        original.cleanup()
        relay.cleanup()


def _refused(clone: RoleProc, timeout: float = 60) -> str:
    """The copy exits with status 2 and one line naming the lease's holder."""
    clone.start()
    clone.proc.wait(timeout)
    text = clone.stderr_path.read_text().split("===== crash harness: start")[-1]
    assert clone.proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "\x1b" not in text, text
    lines = [ln for ln in text.splitlines() if "held by a running process" in ln]
    assert len(lines) == 1, text
    return lines[0]


def test_a_copied_host_is_refused_then_takes_over_a_dead_one(hosts):
    asyncio.run(_scenario(*hosts))


async def _scenario(relay: Relay, original: RoleProc, clone: RoleProc, port_b: int,
                    port_c: int) -> None:
    for role in ("ingress", "egress", "stream"):
        relay.procs[role].start()
    original.start()
    await asyncio.gather(*(relay.procs[r].wait_ready(60) for r in ("ingress", "egress")),
                         relay.procs["stream"].wait_ready(STREAM_READY_TIMEOUT),
                         original.wait_ready(60))
    # the copy's relay key is the original's: its clients cannot tell the two apart
    out = subprocess.run([sys.executable, "-m", "relay.cli", *relay.prefix, "keys"],
                         env=original.env, capture_output=True, text=True, check=True)
    pub_b = bytes.fromhex(dict(line.split() for line in out.stdout.splitlines()
                               if line.strip())["trueseal"])
    receivers = Receivers(relay.receive_port, relay.relay_pub(), MAILBOXES)
    receivers.start()
    seed = random.SystemRandom().randrange(1 << 32)
    log(f"clone, seed {seed}")
    load_b = PushLoad(port_b, pub_b, receivers.mailboxes, PUSHES, LOAD_SECONDS, WORKERS // 2,
                      seed, first_uid=1_000_001)
    load_b.start()
    assert await wait_for(lambda: len(load_b.acked) >= 20, 60)

    # a copy of the running host's data directory, started on "another host": refused
    _copy_data_dir(original.env["RELAY_DATA_DIR"], clone.env["RELAY_DATA_DIR"])
    line = _refused(clone)
    log(f"copy refused: {line}")
    assert original.running and len(load_b.acked) < PUSHES

    await asyncio.sleep(random.Random(seed).uniform(2, 6))
    original.kill9(whole_tree=True)
    killed = time.monotonic()
    await asyncio.sleep(0.5)
    acked_b = set(load_b.acked)
    await load_b.close()
    log(f"node-b killed, {len(acked_b)} acked")
    assert acked_b

    # the dead original's lease is still live for up to LEASE_SECONDS: refused again
    _refused(clone, timeout=30)
    assert time.monotonic() - killed < LEASE_SECONDS
    # once it expired, the copy takes the node over, with the next fencing token
    await asyncio.sleep(max(0.0, LEASE_SECONDS + 0.5 - (time.monotonic() - killed)))
    before = node_lease.read(tables_dir(relay.data), NODE)
    clone.start()
    await clone.wait_ready(60)
    load_c = PushLoad(port_c, pub_b, receivers.mailboxes, PUSHES // 2, LOAD_SECONDS / 2,
                      WORKERS // 2, seed + 1, first_uid=2_000_001)
    load_c.start()
    await load_c.producer_done.wait()
    assert await wait_for(lambda: load_c.unacked == 0, ACK_DEADLINE)
    await load_c.close()
    after = node_lease.read(tables_dir(relay.data), NODE)
    assert after.epoch == before.epoch + 1 and after.pid == clone.proc.pid

    acked = acked_b | set(load_c.acked)
    ok = await wait_for(lambda: acked <= receivers.delivered_uids.keys(), DELIVERY_DEADLINE)
    undelivered = acked - receivers.delivered_uids.keys()
    await receivers.close()
    assert ok, f"{len(undelivered)} acked envelopes not delivered, e.g. {sorted(undelivered)[:10]}"

    # every landing row (the original's and the copy's) reached the inbox once, gap-free
    data = relay.data
    await every_landing_row_in_the_inbox_once(data)
    assert await clone.term(60) == 0
    released = node_lease.read(tables_dir(data), NODE)
    assert released.released                     # a clean stop frees the id at once
    for role in ("ingress", "stream", "egress"):
        assert await relay.procs[role].term(90) == 0
    log(f"delivered {len(acked)} acked envelopes ({len(acked_b)} from the killed original)")
