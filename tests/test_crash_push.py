"""Crash test for the push job: kill -9 mid-burst never loses a wake-up and never wakes a
device twice within a window.

`relay ingress`, `relay stream` and `relay push` run as real child processes
(tests/crash_harness.RoleProc); the APNs provider is relay/bench/push_providers.FakeApns in this
process (HTTP/2 over TLS, the job's production client), answering after a delay so that
requests are in flight when the job dies. Recipients register an APNs token over PPP
(REGISTER_PUSH) and stay offline; senders STORE a steady stream of events to them for
`BURST_SECONDS`, during which the push job is SIGKILLed `KILLS` times at seeded moments
(whole process), each time while provider requests are in flight, and restarted.

Then:
* every stored event is covered by a wake-up of its recipient's device that arrived no more
  than a window before the event was stored, or after (the wake-up told the phone to fetch
  and the event was there, or came later);
* two wake-ups of one device with different collapse ids arrived at least a window apart
  (a re-sent intent, the job having died between recording it and hearing the answer, keeps
  its collapse id: the phone shows it once; such re-sends are counted and reported);
* every intent in push_log has its outcome (the re-sent ones included).

Run: `.venv/bin/pytest -m crash tests/test_crash_push.py -s` (about 2 minutes on 2 cores).
Knobs: CRASH_SEED, CRASH_PUSH_KILLS (2).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import defaultdict

import pytest
from deltalake import DeltaTable
from nacl.signing import SigningKey

from crash_harness import RelayProcesses, log
from ppp_wire import Ws, giftwrap
from relay.bench.push_providers import FakeApns

pytestmark = pytest.mark.crash

ROLES = ("ingress", "stream", "push")
WINDOW = 6.0
RECIPIENTS = 10
SENDERS = 4
BURST_SECONDS = 30.0
KILLS = int(os.environ.get("CRASH_PUSH_KILLS", "2"))
PROVIDER_DELAY = 0.4          # seconds the fake APNs takes to answer
STREAM_READY_TIMEOUT = 240.0
SETTLE_SECONDS = 20.0


def conf(apns: FakeApns) -> str:
    return f"""
[heya]
enabled = false

[sync]
enabled = false

[push]
window_seconds = {WINDOW}

[push.apns]
key_file = "{apns.key_file}"
key_id = "{apns.KEY_ID}"
team_id = "{apns.TEAM}"
topic = "{apns.TOPIC}"
url = "{apns.url}"
ca_file = "{apns.cert}"
"""


class SlowApns(FakeApns):
    """Answers after PROVIDER_DELAY (each write of a connection waits that long)."""

    @property
    def arrivals(self) -> list[tuple[float, str, str]]:
        return self.arrival_times

    async def _serve(self, reader, writer):
        orig = writer.drain

        async def slow_drain():
            await asyncio.sleep(PROVIDER_DELAY)
            await orig()
        writer.drain = slow_drain
        await super()._serve(reader, writer)


def test_push_job_killed_mid_burst(tmp_path):
    asyncio.run(_run(tmp_path))


async def _run(tmp_path):
    seed = int(os.environ.get("CRASH_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    log(f"push crash seed {seed}")
    apns = SlowApns(tmp_path)
    await apns.start()
    relay = RelayProcesses(tmp_path, conf(apns), ROLES)
    try:
        await _scenario(relay, apns, rng)
    except BaseException:
        log(relay.tails())
        raise
    finally:
        relay.cleanup()
        await apns.close()


async def _scenario(relay, apns, rng):
    procs = relay.procs
    for role in ROLES:
        procs[role].start()
    await asyncio.gather(procs["ingress"].wait_ready(60), procs["push"].wait_ready(60),
                         procs["stream"].wait_ready(STREAM_READY_TIMEOUT))
    port = relay.ports["RELAY_PPP_PORT"]
    recipients = [SigningKey.generate() for _ in range(RECIPIENTS)]
    tokens = {}
    for sk in recipients:
        ws = await Ws.login(port, sk)
        tokens[bytes(sk.verify_key)] = token = os.urandom(32).hex()
        assert await ws.call({"cmd": "REGISTER_PUSH", "platform": "apns", "token": token}) == {
            "cmd": "PUSH_REGISTERED"}
        await ws.close()
    senders = [await Ws.login(port, SigningKey.generate()) for _ in range(SENDERS)]

    stored: list[tuple[float, bytes]] = []        # (time stored, recipient)
    kill_at = sorted(rng.uniform(4.0, BURST_SECONDS - 6.0) for _ in range(KILLS))
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < BURST_SECONDS:
        if kill_at and time.monotonic() - t0 >= kill_at[0]:
            kill_at.pop(0)
            # wait until requests are in flight (arrived, not answered yet), then kill
            n = len(apns.arrivals)
            deadline = time.monotonic() + 5
            while len(apns.arrivals) == n and time.monotonic() < deadline:
                await _store(senders, recipients, rng, stored, i)
                i += 1
                await asyncio.sleep(0.05)
            procs["push"].kill9()
            log(f"push job killed at +{time.monotonic() - t0:.1f}s "
                f"({len(apns.arrivals)} requests so far)")
            procs["push"].start()
            await procs["push"].wait_ready(60)
        await _store(senders, recipients, rng, stored, i)
        i += 1
        await asyncio.sleep(rng.uniform(0.1, 0.5))
    await asyncio.sleep(SETTLE_SECONDS)
    for s in senders:
        await s.close()
    assert procs["push"].kills == KILLS

    by_token: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for at, token, collapse in apns.arrivals:
        by_token[token].append((at, collapse))
    # every stored event covered by a wake-up of its recipient no earlier than a window before
    for at, recipient in stored:
        wakes = [w for w, _ in by_token[tokens[recipient]]]
        assert any(w >= at - WINDOW for w in wakes), "an event's wake-up was lost"
    # distinct wake-ups of one device at least a window apart; re-sends keep their collapse id
    resent = 0
    for token, arrivals in by_token.items():
        first: dict[str, float] = {}
        for at, collapse in sorted(arrivals):
            if collapse in first:
                resent += 1
                continue
            first[collapse] = at
        times = sorted(first.values())
        assert all(b - a >= WINDOW - 1.0 for a, b in zip(times, times[1:])), (token, times)
    log(f"{len(stored)} events, {len(apns.arrivals)} provider requests, {resent} re-sent "
        f"after a kill (same collapse id)")
    # every intent has its outcome in push_log
    rows = DeltaTable(str(relay.data / "tables" / "push_log")).to_pyarrow_table().to_pylist()
    intents = {(r["device"], r["wake_at"]) for r in rows if r["outcome"] == "intent"}
    finals = {(r["device"], r["wake_at"]) for r in rows if r["outcome"] != "intent"}
    assert intents and intents <= finals
    assert {r["outcome"] for r in rows if r["outcome"] != "intent"} == {"sent"}


async def _store(senders, recipients, rng, stored, i) -> None:
    recipient = bytes(rng.choice(recipients).verify_key)
    gw, _ = giftwrap(recipient)
    r = await senders[i % len(senders)].call({"cmd": "STORE", "event": gw})
    assert r["cmd"] == "STORED", r
    stored.append((time.time(), recipient))
