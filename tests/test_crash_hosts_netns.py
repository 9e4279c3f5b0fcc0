"""Every protocol across network hosts, with the tables on an S3 server on one of them.

Host A is this network namespace: the S3 server (moto, listening on A's veth address), and a
whole relay on it: ingress for every protocol, the stream and egress. Host B is a network
namespace of its own (`ip netns`, a veth pair, its own address; created here, removed after)
running `relay ingress` for every protocol with its own data directory and node id, the
tables on A's S3 server. Clients of host B run inside B's namespace (a spawned worker that
joins it) and reach B's listeners on B's own loopback, as B's local clients would.

* Round trips across hosts: a Heya SEND on B to a mailbox registered on A (HAVE on A), PPP
  STOREs on B fetched by their recipient on A, a cursor-sync blob pushed on B by a device
  admitted by a group member on A and pulled on A at its acked cursor.
* Host B killed with SIGKILL (its whole process tree) while PPP senders STORE through it: every
  STORE B answered STORED is fetched on A exactly once, and nothing else.

Trueseal across network hosts is `test_crash_peer_netns.py` (the peer channel) and
`test_crash_two_nodes.py` (a node killed mid-load). Crash suite: `pytest -m crash
tests/test_crash_hosts_netns.py` (root; ~2-3 min on 2 cores)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue as queue_mod
import time
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from crash_harness import RelayProcesses, RoleProc, log
from delta_tables.heya_control import mint_inbox_tokens
from delta_tables.layout import Layout
from heya_client import Cert, HeyaClient, register_and_mint, send_line, recv_line
from ppp_wire import Ws, giftwrap
from relay.bench import netns
from relay.bench.s3_server import s3_server
from sync_client import Device, device_session, group_id, pull, push
from test_crash_ppp_sync import fetch_all

pytestmark = pytest.mark.crash

# Sync budgets raised: the test paces its own load (as test_crash_ppp_sync.py does).
CONF = """
[sync]
messages_per_minute = 100000
connections_per_minute = 1000
control_requests_per_minute = 1000
"""
ROLES = ("ingress", "stream", "egress")
STREAM_READY_TIMEOUT = 240.0
DELIVERY_DEADLINE = 120.0      # a few micro-batches on a loaded 2-core machine, S3 on moto
ROUND_TRIP_STORES = 5
LOAD_SENDERS = 4               # PPP's STORE budget is 60 a minute per pubkey (appendix C.3)
KILL_AFTER_ACKS = 40
EXP = 2 ** 40
END = 2220385707


# -- host B's clients: run in B's network namespace (a spawned worker) --------------------------

def _b_round_trips(out, ports: dict, heya_token: bytes, certs: str, bob_pub: bytes,
                   laptop_seed: bytes, group: bytes, admission: list) -> None:
    out.put(asyncio.run(_b_round_trips_async(ports, heya_token, Path(certs), bob_pub,
                                             laptop_seed, group, admission)))


async def _b_round_trips_async(ports, heya_token, certs, bob_pub, laptop_seed, group,
                               admission) -> dict:
    # Heya: carol sends to alice's mailbox (registered on A) with alice's send token.
    carol = await HeyaClient.connect(ports["heya"], Cert(certs, "carol"))
    carol.send(send_line(heya_token, b"across network hosts"))
    await carol.expect(recv_line(b"across network hosts"), timeout=30)
    carol.close()
    # PPP: a sender STOREs gift wraps to bob, who fetches on A.
    sender = await Ws.login(ports["ppp"], SigningKey.generate())
    stored = []
    for i in range(ROUND_TRIP_STORES):
        wrap, _ = giftwrap(bob_pub, ciphertext=b"round trip %d " % i + os.urandom(64))
        r = await sender.call({"cmd": "STORE", "event": wrap})
        assert r.get("cmd") == "STORED", r
        stored.append(wrap)
    await sender.close()
    # cursor-sync: the laptop joins on B with the phone's admission (made on A) and pushes.
    laptop = Device(laptop_seed)
    c, welcome = await device_session(ports["sync"], laptop, group, name="laptop",
                                      admission=admission)
    assert welcome[0] == "Welcome", welcome
    blob = (7).to_bytes(16, "big")
    ack = await c.request(push(blob, b"blob from host b", 0))
    assert ack[0] == "PushAck" and bytes(ack[1]) == blob, ack
    await c.close()
    return {"ppp": stored, "sync_cursor": ack[2]}


def _b_store_load(out, ppp_port: int, bob_pub: bytes) -> None:
    """STOREs until host B goes: each wrap answered STORED is put on `out` as it is acked."""
    asyncio.run(_b_store_load_async(out, ppp_port, bob_pub))


async def _b_store_load_async(out, ppp_port: int, bob_pub: bytes) -> None:
    async def sender(n: int) -> None:
        try:
            ws = await Ws.login(ppp_port, SigningKey.generate())
            for i in range(55):             # under the budget: no refusal to tell apart
                wrap, _ = giftwrap(bob_pub, ciphertext=b"load %d %d " % (n, i) + os.urandom(64))
                r = await asyncio.wait_for(ws.call({"cmd": "STORE", "event": wrap}), 20)
                if r.get("cmd") != "STORED":
                    return
                out.put(wrap)
                await asyncio.sleep(0.05)
        except Exception:       # the host died under us: what it acked is on `out`
            return
    await asyncio.gather(*(sender(n) for n in range(LOAD_SENDERS)))
    out.put(None)


def _spawn_in_b(ns: str, target, *args) -> tuple[mp.Process, mp.Queue]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=netns.in_netns, args=(ns, target, q, *args), daemon=True)
    p.start()
    return p, q


# -- host A's side -------------------------------------------------------------------------------

async def _until_fetched(port: int, sk: SigningKey, wanted: list[bytes]) -> list[bytes]:
    deadline = time.monotonic() + DELIVERY_DEADLINE
    while True:
        got = await fetch_all(port, sk)
        if set(wanted) <= set(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(1.0)


def test_every_protocol_across_network_hosts_with_the_tables_on_s3(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    a = b = None
    with netns.other_host("relayb", 233) as (ns, here, _):
        try:
            with s3_server(host=here) as endpoint:      # the S3 server lives on host A
                root = tmp_path / "a"
                root.mkdir()
                a = RelayProcesses(root, CONF, ROLES, endpoint)
                env_b = dict(a.env, RELAY_DATA_DIR=str(tmp_path / "data-b"),
                             RELAY_NODE_ID="node-b")
                (tmp_path / "logs-b").mkdir()
                b = RoleProc("ingress", env_b, a.prefix, tmp_path / "logs-b")
                b.argv = ["ip", "netns", "exec", ns, *b.argv]
                asyncio.run(_scenario(tmp_path, ns, a, b, endpoint))
        finally:
            for r in (a, b):
                if r is not None:
                    r.cleanup()


async def _scenario(tmp_path: Path, ns: str, a: RelayProcesses, b: RoleProc,
                    endpoint: str) -> None:
    for proc in (*a.procs.values(), b):
        proc.start()
    await asyncio.gather(a.procs["ingress"].wait_ready(90), a.procs["egress"].wait_ready(90),
                         a.procs["stream"].wait_ready(STREAM_READY_TIMEOUT), b.wait_ready(90))
    ports = {p: int(a.env[f"RELAY_{p.upper()}_PORT"]) for p in ("heya", "ppp", "sync")}
    log(f"hosts up: A {ports}, B in {ns}")

    # Host A's side: alice's Heya mailbox, bob the PPP recipient, the phone's sync group.
    tables = a.env["RELAY_TABLES_DIR"]
    (inbox_token,) = mint_inbox_tokens(Layout.at(str(tmp_path / "mint"), tables, endpoint), 1,
                                       fsync=False)
    alice_cert = Cert(tmp_path / "certs", "alice")
    alice, t_hex = await register_and_mint(ports["heya"], alice_cert,
                                           inbox_token.hex().encode(), END)
    bob = SigningKey.generate()
    g = group_id(b"across network hosts")
    laptop_seed = os.urandom(32)
    phone, laptop = Device(), Device(laptop_seed)
    phone_c, welcome = await device_session(ports["sync"], phone, g, name="phone")
    assert welcome[0] == "Welcome", welcome

    # Host B's clients, in B's namespace.
    admission = [phone.id, EXP, phone.admit(g, laptop.id, EXP)]
    proc, q = _spawn_in_b(ns, _b_round_trips, ports, t_hex, str(tmp_path / "certs-b"), bytes(bob.verify_key), laptop_seed, g, admission)
    try:
        done = await asyncio.to_thread(q.get, True, 120)
    finally:
        proc.join(10)
    assert proc.exitcode == 0, f"host B's clients failed\n{b.tail()}"

    # ... arrive on host A through the stream.
    await alice.expect(b"HAVE " + t_hex + b" 1\n", timeout=DELIVERY_DEADLINE)
    got = await _until_fetched(ports["ppp"], bob, done["ppp"])
    assert sorted(got) == sorted(done["ppp"])
    page = await phone_c.request(pull(0, 10))
    assert [(bytes(e[0]), e[1], bytes(e[2])) for e in page[1]] == [
        ((7).to_bytes(16, "big"), done["sync_cursor"], b"blob from host b")]
    alice.close()
    await phone_c.close()

    # Host B killed mid-load: every STORE it acked reaches bob on A, once.
    proc, q = _spawn_in_b(ns, _b_store_load, ports["ppp"], bytes(bob.verify_key))
    acked: list[bytes] = []
    while len(acked) < KILL_AFTER_ACKS:
        item = await asyncio.to_thread(q.get, True, 60)
        assert item is not None, "the load ended before host B was killed"
        acked.append(item)
    b.kill9()
    log(f"host B killed after {len(acked)} acked STOREs")
    while True:
        try:
            item = await asyncio.to_thread(q.get, True, 60)
        except queue_mod.Empty:
            break
        if item is None:
            break
        acked.append(item)
    proc.join(10)
    wanted = done["ppp"] + acked
    got = await _until_fetched(ports["ppp"], bob, wanted)
    assert len(got) == len(set(got)), "an event fetched twice"
    missing = set(wanted) - set(got)
    assert not missing, f"{len(missing)} of {len(acked)} STOREs acked by B never reached A"
    # a STORE B landed but died before answering may arrive too: it was never acked
    extra = set(got) - set(wanted)
    log(f"every one of {len(acked)} STOREs acked by host B fetched on A once"
        f" ({len(extra)} unacked ones landed too)")
