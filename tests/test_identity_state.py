"""Nothing of an identity stays behind once its last session is gone (one address, many
people): a few hundred fresh PPP pubkeys log in from one address on loopback, are evicted
at the address's cap or leave, and every per-identity structure of the real listener is
back to its size before; the rate budgets (kept on purpose for their window, so a client
cannot reset its budget by reconnecting) are empty once the window has passed. The same
for Heya with a fresh certificate per connection and trueseal receive with a fresh device
key. (cursor-sync: a fresh device's HELLO creates a group, a control-table row for good, and
its member's last-seen time with it, which PRESENCE reports.) The hostile suite's same-address scenarios
are these at 10,000 (tests/hostile/test_hostile_same_address.py)."""

from __future__ import annotations

import asyncio
import os

from nacl.signing import SigningKey

from ppp_wire import pack, unpack
from test_ppp_hostile import login
from test_ppp_shell import Clock, node as ppp_node

FRESH = 300       # identities, one connection each
AT_ONCE = 8       # logging in at once (below the address's cap: none evicted before FETCH)


def per_identity(srv) -> dict[str, int]:
    """The size of everything the PPP listener keeps by pubkey, certificate or connection."""
    adm = srv.admission
    return {"admission_slots": adm.total,
            "admission_identities": len(adm._identities),
            "admission_addresses": sum(len(book.by_address) for book in adm._books.values()),
            "sessions_by_pubkey": len(srv.inbox.sessions),
            "last_seen": len(srv.inbox.sessions.last_seen),
            "room_subscriptions": len(srv.rooms._subscribed),
            "knock_admissions": len(srv.service.rooms.knocks._admitted),
            "http_signatures": len(srv._seen_sigs),
            "websockets": srv.connections}


async def until(check, seconds: float) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not in time"
        await asyncio.sleep(0.05)


def test_ppp_fresh_pubkeys_leave_nothing_behind(settings):
    settings.ppp.max_auth_sessions_per_address = 16   # most of them are evicted for the next
    clock = Clock()

    async def go():
        async with ppp_node(settings, clock) as n:
            srv, port = n.ppp, n.ppp.bound_port
            # one user registered for push: its departure is what the push job needs
            pushed = SigningKey.generate()
            ws, r = await login(port, "127.0.0.1", pushed)
            assert r == {"cmd": "AUTH_OK"}
            await ws.send(pack({"cmd": "REGISTER_PUSH", "platform": "apns",
                                "token": os.urandom(32).hex()}))
            assert unpack(await asyncio.wait_for(ws.recv(), 5)) == {"cmd": "PUSH_REGISTERED"}
            await ws.close()
            await until(lambda: srv.admission.total == 0, 5)
            before = per_identity(srv)
            assert before["last_seen"] == 1
            budget_keys = len(srv.budgets)

            held, gate = [], asyncio.Semaphore(AT_ONCE)

            async def one(i: int) -> None:
                async with gate:
                    ws, r = await login(port, "127.0.0.2")
                    assert r == {"cmd": "AUTH_OK"}, r
                    await ws.send(pack({"cmd": "FETCH", "since": 0}))
                    assert unpack(await asyncio.wait_for(ws.recv(), 5))["cmd"] == "EVENTS"
                    held.append(ws)

            await asyncio.gather(*(one(i) for i in range(FRESH)))
            assert len(srv.budgets) == budget_keys + FRESH          # FETCH's, per pubkey
            assert srv.admission.decisions[("auth", "evicted_address_cap")] >= FRESH - 16
            assert len(srv.inbox.sessions) <= 16
            # the rest leave: some close, some vanish (as a killed attacker's do)
            for i, ws in enumerate(held):
                if ws.close_code is not None:
                    continue
                if i % 2:
                    await ws.close()
                else:
                    ws.transport.abort()
            await until(lambda: per_identity(srv)["websockets"] == 0
                        and srv.admission.total == 0, 10)
            assert per_identity(srv) == before
            assert srv.inbox.sessions.last_seen.get(bytes(pushed.verify_key)) is not None
            # the budgets outlive the sessions for their window (60 s for FETCH), no longer
            clock.t += 61
            srv.budgets.sweep(clock())
            assert len(srv.budgets) == 0

    asyncio.run(go())


def test_heya_fresh_certificates_leave_nothing_behind(settings, tmp_path):
    """The same with a fresh self-signed certificate per connection (strangers, PINGing)."""
    from heya_client import Cert, HeyaClient
    from test_heya_shell import node as heya_node

    certs = [Cert(tmp_path / "certs", f"c{i}") for i in range(120)]

    async def go():
        async with heya_node(settings, max_unauth_sessions_per_address=16) as n:
            srv = n.heya
            before = (srv.admission.total, len(srv.admission._identities),
                      len(srv.inbox.sessions), len(srv.inbox.sessions.last_seen))
            held = []
            for cert in certs:
                c = await HeyaClient.connect(srv.bound_port, cert)
                c.send(b"PING\n")
                await c.expect(b"PONG\n")
                held.append(c)
            assert srv.admission.decisions[("unauth", "evicted_address_cap")] >= 100
            for i, c in enumerate(held):
                if i % 2:
                    c.close()
                else:
                    c.writer.transport.abort()
            await until(lambda: srv.admission.total == 0 and not len(srv.inbox.sessions), 10)
            assert (srv.admission.total, len(srv.admission._identities),
                    len(srv.inbox.sessions), len(srv.inbox.sessions.last_seen)) == before

    asyncio.run(go())


def test_trueseal_receive_fresh_device_keys_leave_nothing_behind():
    """The same with a fresh Noise XX static key (device key) per receive session."""
    from loopback import wait_until
    from test_listener_budgets import close_all, trueseal
    from test_trueseal_shells import make_settings, receive_relay, run
    from trueseal_client import XX, keypair

    conf = make_settings(heartbeat_idle_seconds=60.0, heartbeat_timeout_seconds=60.0,
                         max_receive_sessions_per_address=16)

    async def main():
        async with receive_relay(conf) as relay:
            port, srv, hub = relay.server.bound_port, relay.server, relay.hub
            before = (srv.admission.total, len(srv.admission._identities), len(hub._boxes))
            held = []
            for _ in range(120):
                held.append(await trueseal(port, "127.0.0.2", XX, keypair()[0]))
            await wait_until(lambda: srv.admission.decisions[
                ("auth", "evicted_address_cap")] >= 100)
            close_all(held)
            await wait_until(lambda: srv.admission.total == 0 and hub.sessions_open() == 0)
            assert (srv.admission.total, len(srv.admission._identities),
                    len(hub._boxes)) == before

    run(main())
