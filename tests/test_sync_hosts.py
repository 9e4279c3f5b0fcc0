"""cursor-sync on two hosts at once, all real: two `relay ingress --protocol sync` processes
with their own data directories and node ids over one tables directory (`hosts_harness.py`),
QUIC clients whose frames are built byte by byte (`sync_client.py`). A group created on host A
is joined on host B with an admission from a member A admitted (and B's member admits on A);
a device revoked on A is refused on B once B followed, and its admissions admit no one on
either host; a restarted host folds the same membership. (Two hosts creating one group at
once: tests/test_control_hosts.py.)"""

from __future__ import annotations

import asyncio
import time

from hosts_harness import Host
from sync_client import Device, SyncClient, device_session, group_id, hello, join, revoke

EXP = 2 ** 40
FOLLOW_DEADLINE = 15.0


def admission(admitter: Device, group: bytes, joiner: Device) -> list:
    return [admitter.id, EXP, admitter.admit(group, joiner.id, EXP)]


def test_sync_served_by_two_hosts_at_once(tmp_path):
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    iroh = {"RELAY_SYNC_IROH_PORT": "0"}
    a, b = Host(tmp_path, "a", "sync", iroh), Host(tmp_path, "b", "sync", iroh)
    await asyncio.gather(a.start(), b.start())
    clients: list[SyncClient] = []
    try:
        g = group_id(b"family photos")
        phone, laptop, tablet = Device(), Device(), Device()
        c, welcome = await device_session(a.port(), phone, g, name="phone")
        clients.append(c)
        assert welcome[0] == "Welcome"                              # phone creates g on A
        # laptop joins on B with the phone's admission (B looks the phone up in the tables)
        c, welcome = await device_session(b.port(), laptop, g, name="laptop",
                                          admission=admission(phone, g, laptop))
        clients.append(c)
        assert welcome[0] == "Welcome"
        # ... and its own admission of the tablet serves on A
        c, welcome = await device_session(a.port(), tablet, g, name="tablet",
                                          admission=admission(laptop, g, tablet))
        clients.append(c)
        assert welcome[0] == "Welcome"

        # Revoked on A (by the phone): refused on B once B followed.
        assert await clients[0].request(revoke(laptop.id)) == ["Done", "RevokeDevice"]
        deadline = time.monotonic() + FOLLOW_DEADLINE
        while True:
            cb = await SyncClient.connect(b.port())
            clients.append(cb)
            await cb.authenticate(laptop)
            got = await cb.request(hello(2, "laptop", g))
            if got[:2] == ["Error", 1005]:
                break
            assert got[0] == "Welcome" and time.monotonic() < deadline, got
            await asyncio.sleep(0.2)
        # ... and its admissions no longer admit anyone, on either host
        for host in (a, b):
            cc = await SyncClient.connect(host.port())
            clients.append(cc)
            await cc.authenticate(Device())
            got = await cc.request(join(g, *admission(laptop, g, Device())))
            assert got[:2] == ["Error", 1006], got

        # B restarted: the tablet (admitted on A) is a member, the laptop revoked.
        for cl in clients:
            await cl.close()
        clients.clear()
        assert await b.stop() == 0
        await b.start()
        c, welcome = await device_session(b.port(), tablet, g, name="tablet")
        clients.append(c)
        assert welcome[0] == "Welcome"
        c, welcome = await device_session(b.port(), laptop, g, name="laptop")
        clients.append(c)
        assert welcome[:2] == ["Error", 1005]
    finally:
        for cl in clients:
            await cl.close()
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
