"""One address, many people, at the shell level: real listeners on loopback, a few sessions
and low caps. Per protocol: one identity holds at most its budget (its idlest session makes
room for the new one); at an address's cap the session idle longest in application terms
goes, never one mid-delivery. (Address eviction order on every listener, Heya's certificate
budget and the receive listener's unacked-Deliver exemption: tests/test_listener_budgets.py,
test_ppp_hostile.py, test_sync_budgets.py; the same at 1,100 and 10,000 connections:
tests/hostile/test_hostile_same_address.py.)"""

from __future__ import annotations

import asyncio

from nacl.signing import SigningKey
from prometheus_client import CollectorRegistry, generate_latest

from heya_client import Cert, HeyaClient
from loopback import closed_by_server, wait_until
from runtime.metrics import _Collect, _listener_families
from sync_client import Device, device_session, group_id
from test_heya_shell import node as heya_node
from test_listener_budgets import close_all, trueseal
from test_ppp_hostile import login
from test_ppp_shell import Clock, node as ppp_node
from test_sync_shell import relay as sync_relay
from test_trueseal_shells import (GatedAppender, R1, make_settings, push_relay,
                                  receive_relay, run)
from trueseal_client import ACK, XX, keypair, push_frame

TOO_MANY = (2, "too many sessions")


def scrape(listener) -> str:
    """What /metrics says of one listener (runtime/metrics.py's families, as exposed)."""
    reg = CollectorRegistry()
    reg.register(_Collect(lambda: _listener_families([listener])))
    return generate_latest(reg).decode()


def test_trueseal_push_never_evicts_a_session_whose_push_is_being_stored(tmp_path):
    """Two push sessions per address. The idlest one's Push is still being stored (its Ack
    owed): a newcomer evicts the other one, and the Ack still arrives."""
    conf = make_settings(max_push_sessions_per_address=2, push_idle_timeout_seconds=30.0)
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, conf, appender=appender) as relay:
            port, srv = relay.server.bound_port, relay.server
            storing = await trueseal(port, "127.0.0.2")
            storing.send(push_frame(R1, b"slow"))
            await wait_until(lambda: len(appender.gates) == 1)
            worked = await trueseal(port, "127.0.0.2")
            worked.send(push_frame(R1, b"fast"))
            await wait_until(lambda: len(appender.gates) == 2)
            appender.gates[1].set_result(None)
            assert await worked.recv_frame(timeout=5) == ACK
            # idle longest: `storing` (its Push came first), but it is mid-delivery
            newcomer = await trueseal(port, "127.0.0.2")
            assert await closed_by_server(worked.reader, 2)
            assert srv.admission.decisions[("unauth", "evicted_address_cap")] == 1
            scraped = scrape(srv)
            assert ('relay_admission_decisions_total{listener="trueseal_push",protocol='
                    '"trueseal",reason="evicted_address_cap",stage="unauth"} 1.0') in scraped
            assert ('relay_admission_decisions_total{listener="trueseal_push",protocol='
                    '"trueseal",reason="admitted",stage="unauth"} 3.0') in scraped
            appender.gates[0].set_result(None)
            assert await storing.recv_frame(timeout=5) == ACK
            newcomer.send(push_frame(R1, b"newcomer"))
            await wait_until(lambda: len(appender.gates) == 3)
            appender.gates[2].set_result(None)
            assert await newcomer.recv_frame(timeout=5) == ACK
            close_all([storing, newcomer])

    run(main())


def test_trueseal_receive_one_device_key_holds_its_budget():
    """A device key's fifth receive session replaces its idlest; other keys of the same
    address are untouched."""
    conf = make_settings(heartbeat_idle_seconds=60.0, heartbeat_timeout_seconds=60.0,
                         max_receive_sessions_per_key=4)

    async def main():
        async with receive_relay(conf) as relay:
            port, srv = relay.server.bound_port, relay.server
            priv, _ = keypair()
            other = await trueseal(port, "127.0.0.2", XX, keypair()[0])
            mine = [await trueseal(port, "127.0.0.2", XX, priv) for _ in range(4)]
            await wait_until(lambda: relay.hub.sessions_open() == 5)
            fifth = await trueseal(port, "127.0.0.2", XX, priv)
            assert await closed_by_server(mine[0].reader, 2)
            assert not await closed_by_server(other.reader, 0.1)
            assert not await closed_by_server(fifth.reader, 0.1)
            assert srv.admission.decisions[("auth", "evicted_identity_cap")] == 1
            assert srv.admission.sessions_of(bytes(_pub(priv)).hex()) == 4
            close_all(mine + [other, fifth])

    run(main())


def _pub(priv: bytes) -> bytes:
    from nacl.bindings import crypto_scalarmult_base
    return crypto_scalarmult_base(priv)


class _GatedStore:
    """A listener's appender, held until the test lets each append finish."""

    def __init__(self, real):
        self.real, self.gates = real, []

    async def append(self, row):
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        return await self.real.append(row)


def test_heya_never_evicts_a_session_whose_send_is_being_stored(settings, tmp_path):
    """A certificate's budget of two: the idlest session's SEND is being stored (its RECV
    owed), so the other one goes for the newcomer, and the RECV still arrives."""
    from test_heya_shell import auth, mailbox, mint
    from heya_client import recv_line, send_line

    async def go():
        (inbox_token,) = mint(settings)
        async with heya_node(settings, max_sessions_per_certificate=2) as n:
            port, srv = n.heya.bound_port, n.heya
            alice = await mailbox(port, Cert(tmp_path, "alice"), inbox_token)
            t_hex = await auth(alice)
            gated = n.heya.appender = _GatedStore(n.heya.appender)
            sender = Cert(tmp_path, "sender")
            storing = await HeyaClient.connect(port, sender)
            body = b"stored slowly"
            storing.send(send_line(t_hex, body))
            await wait_until(lambda: len(gated.gates) == 1)
            idle = await HeyaClient.connect(port, sender)
            idle.send(b"PING\n")
            await idle.expect(b"PONG\n")
            third = await HeyaClient.connect(port, sender)
            assert await idle.closed_by_server(2)
            assert srv.admission.decisions.get(("auth", "evicted_identity_cap"), 0) \
                + srv.admission.decisions.get(("unauth", "evicted_identity_cap"), 0) == 1
            gated.gates[0].set_result(None)
            await storing.expect(recv_line(body))
            for c in (alice, storing, third):
                c.close()

    asyncio.run(go())


def test_ppp_one_pubkey_holds_its_budget(settings):
    """A pubkey's fifth WebSocket replaces its idlest (the one that FETCHed last stays)."""
    settings.ppp.max_sessions_per_pubkey = 4

    async def go():
        async with ppp_node(settings, Clock()) as n:
            port = n.ppp.bound_port
            sk = SigningKey.generate()
            mine = []
            for _ in range(4):
                ws, r = await login(port, "127.0.0.2", sk)
                assert r == {"cmd": "AUTH_OK"}
                mine.append(ws)
            from ppp_wire import pack, unpack
            await mine[0].send(pack({"cmd": "FETCH", "since": 0}))
            assert unpack(await asyncio.wait_for(mine[0].recv(), 5))["cmd"] == "EVENTS"
            fifth, r = await login(port, "127.0.0.3", sk)    # another address, same key
            assert r == {"cmd": "AUTH_OK"}
            await asyncio.wait_for(mine[1].wait_closed(), 5)  # idle longest of the key
            assert n.ppp.admission.decisions[("auth", "evicted_identity_cap")] == 1
            assert n.ppp.admission.sessions_of(bytes(sk.verify_key).hex()) == 4
            for ws in mine[:1] + mine[2:] + [fifth]:
                assert ws.close_code is None
                await ws.close()

    asyncio.run(go())


def test_sync_one_device_holds_its_budget(settings):
    """A device's third session (budget two) replaces its idlest, closed with code 2."""
    settings.sync.max_sessions_per_device = 2

    async def go():
        async with sync_relay(settings, stream=False) as (port, node, _):
            srv, dev, g = node.sync, Device(), group_id(b"budget")
            first, w1 = await device_session(port, dev, g, local_host="127.0.0.2")
            second, w2 = await device_session(port, dev, g, local_host="127.0.0.2")
            assert w1[0] == w2[0] == "Welcome"
            third, w3 = await device_session(port, dev, g, local_host="127.0.0.3")
            assert w3[0] == "Welcome"
            assert await first.closed(5) == TOO_MANY
            assert srv.admission.decisions[("auth", "evicted_identity_cap")] == 1
            assert srv.admission.sessions_of(dev.id.hex()) == 2
            for c in (first, second, third):
                await c.close()

    asyncio.run(go())


def test_sync_never_evicts_a_session_whose_push_is_being_acked(settings):
    """Two sessions per address. The idlest one's PUSH waits for its inbox commit (no stream
    runs here: its PUSH_ACK stays owed), so the newcomer takes the other one's slot."""
    from sync_client import pull, push
    from test_sync_shell import admission, blob
    settings.sync.max_sessions_per_address = 2
    settings.sync.push_ack_timeout_seconds = 30.0

    async def go():
        async with sync_relay(settings, stream=False) as (port, node, _):
            srv, g, owner = node.sync, group_id(b"busy"), Device()
            storing, w = await device_session(port, owner, g, local_host="127.0.0.2")
            assert w[0] == "Welcome"
            pending = asyncio.ensure_future(storing.request(push(blob(1), b"waits", 0)))
            await wait_until(lambda: storing_busy(srv))
            other_dev = Device()
            worked, w = await device_session(port, other_dev, g, local_host="127.0.0.2",
                                             admission=admission(owner, g, other_dev))
            assert w[0] == "Welcome"
            await worked.request(pull(0, 10))           # worked is the more recent now
            newcomer, w = await device_session(port, Device(), group_id(b"new"),
                                               local_host="127.0.0.2")
            assert w[0] == "Welcome"
            assert await worked.closed(5) == TOO_MANY   # not `storing`, idle longer but busy
            assert srv.admission.decisions[("auth", "evicted_address_cap")] == 1
            assert not pending.done()
            pending.cancel()
            for c in (storing, worked, newcomer):
                await c.close()

    asyncio.run(go())


def storing_busy(srv) -> bool:
    return any(c.tasks for c in srv.conns)


def test_ppp_never_evicts_a_session_whose_store_is_being_landed(settings):
    """Two WebSockets per address. The idlest one's STORE is being landed (its STORED owed),
    so the newcomer takes the other one's slot, and STORED still arrives."""
    import os
    from ppp_wire import giftwrap, pack, unpack
    settings.ppp.max_auth_sessions_per_address = 2

    async def go():
        async with ppp_node(settings, Clock()) as n:
            port, service = n.ppp.bound_port, n.ppp.service
            gated = service.appender = _GatedStore(service.appender)
            storing, r = await login(port, "127.0.0.2")
            assert r == {"cmd": "AUTH_OK"}
            ev, eid = giftwrap(os.urandom(32))
            await storing.send(pack({"cmd": "STORE", "event": ev}))
            await wait_until(lambda: len(gated.gates) == 1)
            worked, r = await login(port, "127.0.0.2")
            await worked.send(pack({"cmd": "FETCH", "since": 0}))
            assert unpack(await asyncio.wait_for(worked.recv(), 5))["cmd"] == "EVENTS"
            newcomer, r = await login(port, "127.0.0.2")
            assert r == {"cmd": "AUTH_OK"}
            await asyncio.wait_for(worked.wait_closed(), 5)   # not `storing`: it is busy
            assert n.ppp.admission.decisions[("auth", "evicted_address_cap")] == 1
            gated.gates[0].set_result(None)
            reply = unpack(await asyncio.wait_for(storing.recv(), 5))
            assert reply == {"cmd": "STORED", "event_id": eid}
            for ws in (storing, newcomer):
                await ws.close()

    asyncio.run(go())
