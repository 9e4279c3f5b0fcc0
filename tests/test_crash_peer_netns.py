"""The peer channel between two network hosts (runtime/peer_link.py): ingress on this host,
egress (or a second PPP listener) on a host of its own (a network namespace with its own
address, joined by a veth pair; created here and removed after), each with its own data
directory, keys and node id, the tables shared. A receiver connected to the egress host over
the veth gets pushes made to the ingress host before any inbox row exists (no stream runs);
egress killed with SIGKILL drops the channel, and its registration expires with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from datetime import datetime, timezone

import pytest
from nacl.signing import SigningKey

from crash_harness import RoleProc, free_ports
from delta_tables import peer_registry
from delta_tables.layout import Layout
from deltalake import DeltaTable
from egress.pending import EARLY_BASE
from engine.ppp.keys import Identity
from ppp_wire import Ws
from relay.bench import netns
from runtime import config
from test_end_to_end import parse_deliver
from test_peer_hosts import host_env, start_hosts, wait_log
from test_ppp_end_to_end import presence
from trueseal_client import ACK, NK, XX, AsyncClient, keypair, push_frame

pytestmark = pytest.mark.crash

PUSHES = 20
STORES = 10


@contextlib.contextmanager
def network_host():
    """A network namespace joined to this host by a veth pair: (its name, this host's
    address, its address); removed after."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    with netns.other_host("relaypeer", 232) as host:
        yield host


def run_then_clean(main, *procs: RoleProc) -> None:
    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            proc.cleanup()


async def no_rows_then_b_gone(tmp_path, tables, a: RoleProc, b: RoleProc, a_name: str) -> None:
    """No stream ran, so no inbox row exists (what B got came over the channel); then host B
    is killed with SIGKILL: A sees the channel drop, B's registration expires, A stops clean."""
    settings = config.load(None, env={}, data_dir=str(tmp_path / "x"), tables_dir=str(tables))
    assert DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().num_rows == 0
    b.kill9()
    await wait_log(a, "peer_disconnected", 10)
    time.sleep(3.5)
    now = datetime.now(timezone.utc)
    assert [p.name for p in peer_registry.live(tables, now)] == [a_name]
    assert await a.term(30) == 0


def test_pushes_reach_a_receiver_on_another_network_host_early(tmp_path):
    with network_host() as (ns, here, there):
        _pushes_across(tmp_path, ns, here, there)


def _pushes_across(tmp_path, ns: str, here: str, there: str) -> None:
    tables = tmp_path / "tables"
    push, peer, receive = free_ports(3)
    (tmp_path / "logs").mkdir()
    ingress = RoleProc("ingress-trueseal", host_env(
        tmp_path, "a", tables, RELAY_TRUESEAL_PUSH_PORT=str(push),
        RELAY_CLUSTER__PEER_LISTEN="true", RELAY_CLUSTER__PEER_BIND=here,
        RELAY_CLUSTER__PEER_PORT=str(peer), RELAY_INGRESS__LEASE_SECONDS="3",
        RELAY_INGRESS__LEASE_RENEW_SECONDS="1"),
        [], tmp_path / "logs", command=["ingress", "--protocol", "trueseal"])
    egress = RoleProc("egress", host_env(
        tmp_path, "b", tables, RELAY_NODE_ID="host-b", RELAY_BIND=there,
        RELAY_CLUSTER__PEER_DIAL="true", RELAY_TRUESEAL__RECEIVE_PORT=str(receive),
        RELAY_INGRESS__LEASE_SECONDS="3", RELAY_INGRESS__LEASE_RENEW_SECONDS="1"),
        [], tmp_path / "logs")
    egress.argv = ["ip", "netns", "exec", ns, *egress.argv]     # egress on host B

    async def main():
        a_pub, b_pub = await start_hosts(ingress, egress, tmp_path)
        listed = {p.name: p for p in peer_registry.live(tables)}
        assert listed["node-0-trueseal"].endpoint == f"{here}:{peer}"
        assert "host-b-egress" in listed
        receivers = []
        for _ in range(2):
            priv, pub = keypair()
            receivers.append((await AsyncClient.connect(receive, XX, b_pub, static_priv=priv,
                                                        host=there), pub))
        await asyncio.sleep(1.0)        # the subscriptions cross to host A
        sent: dict[bytes, list[bytes]] = {pub: [] for _, pub in receivers}
        for i in range(PUSHES):
            _, pub = receivers[i % 2]
            envelope = b"sealed-%d-" % i + os.urandom(200)
            tx = await AsyncClient.connect(push, NK, a_pub)
            tx.send(push_frame(pub, envelope))
            assert await tx.recv_frame(timeout=10) == ACK
            tx.close()
            sent[pub].append(envelope)
        for rx, pub in receivers:
            got = []
            while len(got) < len(sent[pub]):
                blob_id, env = parse_deliver(await rx.recv_frame(timeout=5))
                assert blob_id >= EARLY_BASE        # before its inbox row
                got.append(env)
            assert got == sent[pub]                 # in landing order, each once
            rx.close()
        await no_rows_then_b_gone(tmp_path, tables, ingress, egress, "node-0-trueseal")
    run_then_clean(main, egress, ingress)


def test_stores_reach_a_ppp_recipient_on_another_network_host_early(tmp_path):
    """PPP on both hosts (each a listener and a dialler), Bob connected to host B over the
    veth: Alice's STOREs on host A reach him (NOTIFY, FETCH) before any inbox row exists, each
    once; host B killed with SIGKILL drops the channel and its registration expires."""
    with network_host() as (ns, here, there):
        _stores_across(tmp_path, ns, here, there)


def _stores_across(tmp_path, ns: str, here: str, there: str) -> None:
    tables = tmp_path / "tables"
    a_port, b_port, a_peer, b_peer = free_ports(4)
    (tmp_path / "logs").mkdir()
    quick = {"RELAY_CLUSTER__PEER_LISTEN": "true", "RELAY_CLUSTER__PEER_DIAL": "true",
             "RELAY_INGRESS__LEASE_SECONDS": "3", "RELAY_INGRESS__LEASE_RENEW_SECONDS": "1",
             "RELAY_PPP__NOTIFY_WINDOW_MS": "20"}
    a = RoleProc("ingress-ppp", host_env(
        tmp_path, "a", tables, RELAY_NODE_ID="host-a", RELAY_BIND=here,
        RELAY_PPP_PORT=str(a_port), RELAY_CLUSTER__PEER_PORT=str(a_peer), **quick),
        [], tmp_path / "logs", command=["ingress", "--protocol", "ppp"])
    b = RoleProc("ingress-ppp", host_env(
        tmp_path, "b", tables, RELAY_NODE_ID="host-b", RELAY_BIND=there,
        RELAY_PPP_PORT=str(b_port), RELAY_CLUSTER__PEER_PORT=str(b_peer), **quick),
        [], tmp_path / "logs", command=["ingress", "--protocol", "ppp"])
    b.argv = ["ip", "netns", "exec", ns, *b.argv]             # host B
    b.stderr_path = tmp_path / "logs" / "ingress-ppp-b.stderr"

    async def main():
        a.start()
        b.start()
        await a.wait_ready(60)
        await b.wait_ready(60)
        await wait_log(a, "peer_connected")
        await wait_log(b, "peer_connected")
        listed = {p.name: p for p in peer_registry.live(tables)}
        assert listed["host-a-ppp"].endpoint == f"{here}:{a_peer}"
        assert listed["host-b-ppp"].endpoint == f"{there}:{b_peer}"
        alice, bob = Identity.generate(), Identity.generate()
        bob_b = await Ws.login(b_port, SigningKey(bob.seed), host=there)
        alice_a = await Ws.login(a_port, SigningKey(alice.seed), host=here)
        await asyncio.sleep(1.0)        # bob's subscription crosses to host A
        wraps = [presence(alice, bob, f"across the veth {i}") for i in range(STORES)]
        for gw in wraps:
            assert (await alice_a.call({"cmd": "STORE", "event": gw.encode()}))["cmd"] \
                == "STORED"
        notified = 0
        while notified < STORES:
            m = await bob_b.recv(timeout=5)
            assert m["cmd"] == "NOTIFY"
            notified += m["count"]
        assert notified == STORES
        got = await bob_b.call({"cmd": "FETCH", "since": 0})
        assert got["events"] == [gw.encode() for gw in wraps]   # landing order, each once
        for ws in (alice_a, bob_b):
            await ws.close()
        await no_rows_then_b_gone(tmp_path, tables, a, b, "host-a-ppp")
    run_then_clean(main, b, a)
