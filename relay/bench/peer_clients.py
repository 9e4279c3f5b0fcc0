"""The client shapes of `relay bench --peer`, for our PPP relay or the Nostr peer.

Run as a script, one protocol and shape per run, printing one JSON line:

    python peer_clients.py ppp   --port P senders  --clients N --seconds S
    python peer_clients.py nostr --port P delivery --events N

It runs under our virtualenv for PPP (the PPP client of `relay/bench/ppp.py`: msgpack over
WebSockets, Ed25519 AUTH) and under the peer's for Nostr (NIP-01 JSON over WebSockets, BIP-340
signatures with coincurve, which nostr-relay itself depends on), so neither relay's code is
on the other's client path. The events are the same size: a PPP GiftWrap with a 1,040-byte
ciphertext, a Nostr kind-1059 gift wrap with the same bytes in base64 content.

* `senders`: N connections, each sending one event and waiting for its ack before the next
  (PPP STORE -> STORED, Nostr EVENT -> OK), for S seconds. PPP's spec budget (appendix C.3:
  60 STOREs per pubkey per minute) makes each PPP sender log in as a new identity every 60
  STOREs; the time of those logins is left out of its rate (Nostr has no login).
* `delivery`: one recipient online, one sender, one event at a time: from the send to the
  event in the recipient's hand (PPP: NOTIFY, then FETCH; Nostr: the subscription's EVENT).
* `first-ack`: started before the relay; once the port arrives on stdin, one event on a new
  connection every 20 ms until one is acked (its CLOCK_MONOTONIC time, for start to first ack).
* `crash`: N senders one event after another until the relay is killed under them: the ids
  acked before the kill. `stored` (Nostr): which of the ids on stdin a REQ by id returns.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import sys
import time

CIPHERTEXT_BYTES = 1040      # relay/bench/ppp.py CT_SIZE: a 1,024-byte bucket + its tag
WARMUP = 20


# --- Nostr (NIP-01) -----------------------------------------------------------------------

class Nostr:
    def __init__(self, port: int):
        self.url = f"ws://127.0.0.1:{port}"

    @staticmethod
    def _keys():
        from coincurve import PrivateKey
        from coincurve.keys import PublicKeyXOnly
        sk = PrivateKey()
        return sk, PublicKeyXOnly.from_secret(sk.secret).format().hex()

    def _event(self, sk, pub: str, recipient: str) -> dict:
        ev = {"pubkey": pub, "created_at": int(time.time()), "kind": 1059,
              "tags": [["p", recipient]],
              "content": base64.b64encode(os.urandom(CIPHERTEXT_BYTES)).decode()}
        body = json.dumps([0, ev["pubkey"], ev["created_at"], ev["kind"], ev["tags"],
                           ev["content"]], separators=(",", ":"), ensure_ascii=False)
        ev["id"] = hashlib.sha256(body.encode()).hexdigest()
        ev["sig"] = sk.sign_schnorr(bytes.fromhex(ev["id"])).hex()
        return ev

    async def _connect(self):
        from websockets.asyncio.client import connect
        return await connect(self.url, max_size=8 << 20, open_timeout=60)

    async def sender(self, seconds: float) -> dict:
        sk, pub = self._keys()
        to = self._keys()[1]
        ws = await self._connect()
        lat, busy = [], 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            ev = self._event(sk, pub, to)
            t0 = time.perf_counter()
            await ws.send(json.dumps(["EVENT", ev]))
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if m[0] == "OK" and m[1] == ev["id"]:
                    break
            assert m[2] is True, m
            dt = time.perf_counter() - t0
            lat.append(dt * 1000)
            busy += dt
        await ws.close()
        return {"acked": len(lat), "busy_s": busy, "ack_ms": lat}

    async def store_once(self, keys) -> str:
        """One EVENT on a new connection, answered OK: its id (hex)."""
        sk, pub, to = keys
        ws = await self._connect()
        try:
            ev = self._event(sk, pub, to)
            await ws.send(json.dumps(["EVENT", ev]))
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if m[0] == "OK" and m[1] == ev["id"]:
                    assert m[2] is True, m
                    return ev["id"]
        finally:
            await ws.close()

    def identity(self):
        sk, pub = self._keys()
        return sk, pub, self._keys()[1]

    async def crash_sender(self, seconds: float, acked: list) -> None:
        """Events one after another until the relay is killed (or `seconds` pass): the ids
        it answered OK for go to `acked`."""
        sk, pub = self._keys()
        to = self._keys()[1]
        ws = await self._connect()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            ev = self._event(sk, pub, to)
            await ws.send(json.dumps(["EVENT", ev]))
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if m[0] == "OK" and m[1] == ev["id"]:
                    break
            if m[2] is True:
                acked.append(ev["id"])

    async def stored(self, ids: list[str]) -> list[str]:
        """Which of `ids` the relay returns to a REQ by id (NIP-01), in chunks."""
        ws = await self._connect()
        found: list[str] = []
        for i in range(0, len(ids), 100):
            await ws.send(json.dumps(["REQ", f"c{i}", {"ids": ids[i:i + 100]}]))
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if m[0] == "EVENT":
                    found.append(m[2]["id"])
                elif m[0] == "EOSE":
                    break
                elif m[0] in ("NOTICE", "CLOSED"):
                    raise RuntimeError(f"REQ refused: {m}")
            await ws.send(json.dumps(["CLOSE", f"c{i}"]))
        await ws.close()
        return found

    async def delivery(self, events: int) -> dict:
        sk, pub = self._keys()
        rsk, rpub = self._keys()
        rx, tx = await self._connect(), await self._connect()
        await rx.send(json.dumps(["REQ", "bench", {"kinds": [1059], "#p": [rpub],
                                                   "since": int(time.time()) - 5}]))
        while json.loads(await asyncio.wait_for(rx.recv(), 60))[0] != "EOSE":
            pass
        out = []
        for i in range(events + WARMUP):
            ev = self._event(sk, pub, rpub)
            t0 = time.perf_counter()
            await tx.send(json.dumps(["EVENT", ev]))
            while True:
                m = json.loads(await asyncio.wait_for(rx.recv(), 60))
                if m[0] == "EVENT" and m[2]["id"] == ev["id"]:
                    break
            t1 = time.perf_counter()
            while json.loads(await asyncio.wait_for(tx.recv(), 60))[0] != "OK":
                pass
            if i >= WARMUP:
                out.append((t1 - t0) * 1000)
        await rx.close()
        await tx.close()
        return {"delivery_ms": out}


# --- PPP (spec 004) -------------------------------------------------------------------------

class Ppp:
    STORES_PER_IDENTITY = 60     # appendix C.3

    def __init__(self, port: int):
        self.port = port
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        from relay.bench import ppp
        self.ppp = ppp

    async def _store_loop(self, seconds: float, on_reply) -> None:
        """STORE one event after another for `seconds`, a new identity every 60 (C.3; the
        logins are not timed); `on_reply(reply, seconds from STORE to reply)`."""
        import msgpack
        to = os.urandom(32)
        ws, n = None, 0
        deadline = time.perf_counter() + seconds
        try:
            while time.perf_counter() < deadline:
                if n % self.STORES_PER_IDENTITY == 0:
                    if ws is not None:
                        await ws.close()
                    ws, _ = await self.ppp._login(self.port)
                event = self.ppp._wrap(to)
                t0 = time.perf_counter()
                await ws.send(msgpack.packb({"cmd": "STORE", "event": event},
                                            use_bin_type=True))
                m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60), raw=False)
                on_reply(m, time.perf_counter() - t0)
                n += 1
        finally:
            if ws is not None:
                await ws.close()

    async def sender(self, seconds: float) -> dict:
        lat = []

        def reply(m, dt):
            assert m["cmd"] == "STORED", m
            lat.append(dt * 1000)
        await self._store_loop(seconds, reply)
        return {"acked": len(lat), "busy_s": sum(lat) / 1000, "ack_ms": lat}

    def identity(self):
        return None

    async def store_once(self, _keys) -> str:
        """Log in and STORE one event on a new connection, answered STORED: its id (hex)."""
        import msgpack
        ws, _ = await self.ppp._login(self.port)
        try:
            await ws.send(msgpack.packb({"cmd": "STORE", "event": self.ppp._wrap(os.urandom(32))},
                                        use_bin_type=True))
            m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60), raw=False)
            assert m["cmd"] == "STORED", m
            return m["event_id"].hex()
        finally:
            await ws.close()

    async def crash_sender(self, seconds: float, acked: list) -> None:
        def reply(m, _dt):
            if m["cmd"] == "STORED":
                acked.append(m["event_id"].hex())
        await self._store_loop(seconds, reply)

    async def delivery(self, events: int) -> dict:
        class Out:
            def put(self, res):
                self.res = res
        out = Out()
        await self.ppp._lone_worker(out, self.port, events)
        return {"delivery_ms": out.res["delivered_ms"]}


async def _senders(client, clients: int, seconds: float) -> dict:
    runs = await asyncio.gather(*(client.sender(seconds) for _ in range(clients)))
    lat = [x for r in runs for x in r["ack_ms"]]
    return {"clients": clients, "acked": len(lat),
            # each sender's own rate (acked / time spent sending), summed
            "acked_per_s": sum(r["acked"] / r["busy_s"] for r in runs if r["busy_s"] > 0),
            "ack_ms": lat}


async def _first_ack(client) -> dict:
    """Ready first (imports done, keys made), then the port on stdin: from that moment, a
    new connection and one event every 20 ms until one is acked. Its time is
    CLOCK_MONOTONIC, which the bench compares with the moment it started the relay."""
    keys = client.identity()
    print(json.dumps({"ready": True}), flush=True)
    port = int(await asyncio.to_thread(sys.stdin.readline))
    client.port = port
    if hasattr(client, "url"):
        client.url = f"ws://127.0.0.1:{port}"
    tries = 0
    while True:
        tries += 1
        try:
            await client.store_once(keys)
            return {"acked_at": time.monotonic(), "tries": tries}
        except Exception as e:      # not listening yet, or closed while starting
            last = e
        if tries > 3000:
            raise RuntimeError(f"no ack after {tries} tries: {last!r}")
        await asyncio.sleep(0.02)


async def _crash(client, clients: int, seconds: float) -> dict:
    """`clients` senders until the relay is killed under them: the ids acked before."""
    acked: list[str] = []

    async def one():
        try:
            await client.crash_sender(seconds, acked)
        except Exception:      # the kill: the connection is gone
            pass
    await asyncio.gather(*(one() for _ in range(clients)))
    return {"acked_ids": acked}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("protocol", choices=["ppp", "nostr"])
    ap.add_argument("--port", type=int, required=True)
    sub = ap.add_subparsers(dest="shape", required=True)
    s = sub.add_parser("senders")
    s.add_argument("--clients", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    d = sub.add_parser("delivery")
    d.add_argument("--events", type=int, required=True)
    sub.add_parser("first-ack")
    c = sub.add_parser("crash")
    c.add_argument("--clients", type=int, required=True)
    c.add_argument("--seconds", type=float, required=True)
    sub.add_parser("stored")       # ids on stdin, one JSON list
    a = ap.parse_args(argv)
    client = (Ppp if a.protocol == "ppp" else Nostr)(a.port)
    if a.shape == "senders":
        res = asyncio.run(_senders(client, a.clients, a.seconds))
    elif a.shape == "first-ack":
        res = asyncio.run(_first_ack(client))
    elif a.shape == "crash":
        res = asyncio.run(_crash(client, a.clients, a.seconds))
    elif a.shape == "stored":
        res = {"found": asyncio.run(client.stored(json.loads(sys.stdin.read())))}
    else:
        res = asyncio.run(client.delivery(a.events))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
