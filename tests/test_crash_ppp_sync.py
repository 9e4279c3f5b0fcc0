"""Crash test for PPP and cursor-sync: "acked means durable" under kill -9.

`relay ingress` and `relay stream` run as real child processes (tests/crash_harness.RoleProc,
free ports through RELAY_PPP_PORT / RELAY_SYNC_PORT / ...). While

* PPP senders STORE gift wraps (built from the spec's key table, tests/ppp_wire.py) to a few
  recipients over authenticated WebSockets, a few pipelined per round trip, and
* cursor-sync devices in two groups PUSH blobs over QUIC (tests/sync_client.py), a few
  concurrent streams at a time,

ingress is SIGKILLed twice and the stream twice (whole process tree: driver, JVM, workers),
in a seeded order, each at a moment with STOREs / PUSHes in flight (one stream kill just after
an inbox commit; one ingress kill while the stream is down, so landed-but-unacked retries land
twice and the stream must drop the copies), then restarted. A client that loses its
connection (or gets a retryable refusal) retries over a new one with the SAME bytes / the same
blob id; a PPP retry of an event that may have landed must be answered STORED or STORE_FAIL
"duplicate event" (both count as stored, once); a first attempt answered "duplicate" is a
violation.

At the end, with both roles up and drained (and once more after a clean ingress restart, so
the listener views are rebuilt from the inbox table):

* PPP: every stored event is returned by FETCH (paginated) to its recipient exactly once, and
  nothing else is (no phantom); inbox event ids unique, per-recipient cursors 1..n.
* cursor-sync: every PUSH_ACKed blob is returned by PULL at its acked cursor with its payload;
  a re-push answers the same cursor; per-group cursors are gap-free 1..n.
* landing = inbox + duplicate rejects.

Run: `.venv/bin/pytest -m crash tests/test_crash_ppp_sync.py -s` (excluded by the default
addopts; about 60-80 s on 2 cores).
Knobs (environment): CRASH_SEED, CRASH_PPP_SENDERS (8), CRASH_PPP_RECIPIENTS (3),
CRASH_SYNC_DEVICES (3 per group), CRASH_SYNC_GROUPS (2).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
from deltalake import DeltaTable
from nacl.signing import SigningKey
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from crash_harness import (RelayProcesses, landing_generations, latest_commit, log,
                           tables_dir)
from ppp_wire import Ws, giftwrap
from sync_client import Device, SyncClient, group_id, hello, join, pull, push

pytestmark = pytest.mark.crash

ROLES = ("ingress", "stream")
PPP_SENDERS = int(os.environ.get("CRASH_PPP_SENDERS", "8"))
PPP_RECIPIENTS = int(os.environ.get("CRASH_PPP_RECIPIENTS", "3"))
SYNC_GROUPS = int(os.environ.get("CRASH_SYNC_GROUPS", "2"))
SYNC_DEVICES = int(os.environ.get("CRASH_SYNC_DEVICES", "3"))       # per group
MAX_PER_CLIENT = 100         # events / blobs one client produces at most (a safety cap:
                             # the load runs until the chaos is over)
RESTORE_SAMPLE = 50          # PPP events per sender STOREd again at the end (budget 60 / min)
STREAM_READY_TIMEOUT = 240.0
SETTLE_DEADLINE = 150.0      # after the chaos: every event stored / blob acked by then
CONNECT_TIMEOUT = 5.0        # a QUIC handshake to a dead port hangs (UDP): give up after this
PUSH_TIMEOUT = 45.0          # > sync.push_ack_timeout_seconds (30): the relay answers first

# Heya off (not under test). The sync rate limits are raised: the load is paced by the test,
# and a device re-pushes all its blobs at the end (the default 100 messages/min would refuse
# some, which is correct but not what this test is about). PPP's budgets are appendix C's
# and not configurable; the load stays under them and a "rate limited" refusal is retried.
CONF = """
[heya]
enabled = false

[sync]
messages_per_minute = 100000
connections_per_minute = 1000
control_requests_per_minute = 1000
"""


class Relay(RelayProcesses):
    def __init__(self, tmp_path: Path, s3_endpoint: str | None = None):
        super().__init__(tmp_path, CONF, ROLES, s3_endpoint)
        self.ppp_port = self.ports["RELAY_PPP_PORT"]
        self.sync_port = self.ports["RELAY_SYNC_PORT"]


@pytest.fixture
def relay(tmp_path, s3_endpoint):
    r = Relay(tmp_path, s3_endpoint)
    log(f"data dir {r.data}, ppp :{r.ppp_port}, sync :{r.sync_port}")
    try:
        yield r
    finally:
        r.cleanup()


# -- PPP senders -------------------------------------------------------------------------------

@dataclass
class PppEvent:
    sender: int
    recipient: int
    wrap: bytes
    eid: bytes
    attempts: int = 0
    maybe_landed: bool = False    # an attempt went unanswered: it may have landed
    outcome: str | None = None    # "stored" | "duplicate" (a retry found it held)


@dataclass
class LoadStats:
    sessions: int = 0
    connect_failures: int = 0
    lost: int = 0                 # requests whose reply never came (connection lost)
    retries: int = 0
    refusals: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


def wrap_id(wrap: bytes) -> bytes:
    """§4.5 authenticated-path id of an encoded GiftWrap: BLAKE2b-256(epk ‖ nonce ‖ ct)."""
    m = msgpack.unpackb(wrap, raw=False, strict_map_key=False)
    return hashlib.blake2b(m[2] + m[3] + m[4], digest_size=32).digest()


class PppLoad:
    def __init__(self, port: int, seed: int):
        self.port = port
        self.rng = random.Random(seed)
        self.senders = [SigningKey(self.rng.randbytes(32)) for _ in range(PPP_SENDERS)]
        self.recipients = [SigningKey(self.rng.randbytes(32)) for _ in range(PPP_RECIPIENTS)]
        self.events: list[PppEvent] = []
        self.stats = LoadStats()
        self.in_flight = 0
        self.stop_producing = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.seed = seed

    @property
    def stored(self) -> list[PppEvent]:
        return [e for e in self.events if e.outcome]

    @property
    def unstored(self) -> int:
        return sum(1 for e in self.events if not e.outcome)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._sender(i), name=f"ppp-{i}")
                      for i in range(PPP_SENDERS)]

    def _new_event(self, i: int, rng: random.Random) -> PppEvent:
        r = rng.randrange(PPP_RECIPIENTS)
        ct = rng.randbytes(rng.choice([64, 400, 1040, 3000]))
        wrap, eid = giftwrap(bytes(self.recipients[r].verify_key), ciphertext=ct,
                             ephemeral_pk=rng.randbytes(32), nonce=rng.randbytes(24))
        ev = PppEvent(i, r, wrap, eid)
        self.events.append(ev)
        return ev

    async def _sender(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        st = self.stats
        outbox: deque[PppEvent] = deque()
        made = 0
        ws: Ws | None = None
        try:
            while True:
                if not outbox:
                    if self.stop_producing.is_set() or made >= MAX_PER_CLIENT:
                        return
                    await asyncio.sleep(rng.uniform(2.5, 6.5))     # ~50 / min: C.3 is 60
                    for _ in range(min(rng.choice([1, 2, 4, 8]), MAX_PER_CLIENT - made)):
                        outbox.append(self._new_event(i, rng))
                        made += 1
                if ws is None:
                    try:
                        ws = await asyncio.wait_for(Ws.login(self.port, self.senders[i]),
                                                    CONNECT_TIMEOUT)
                        st.sessions += 1
                    except (OSError, EOFError, ConnectionClosed, InvalidHandshake,
                            asyncio.TimeoutError, AssertionError):
                        st.connect_failures += 1
                        await asyncio.sleep(0.2)
                        continue
                batch = list(outbox)[:rng.choice([1, 2, 4, 8])]
                if not await self._store_batch(ws, batch, outbox):
                    try:
                        await asyncio.wait_for(ws.close(), 2.0)
                    except Exception:
                        pass
                    ws = None                  # lost: reconnect, send the same bytes again
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                elif any(ev.outcome is None for ev in batch):
                    await asyncio.sleep(rng.uniform(0.5, 2.0))    # refused: retry later
        finally:
            if ws is not None:
                try:
                    await ws.close()
                except Exception:
                    pass

    async def _store_batch(self, ws: Ws, batch: list[PppEvent], outbox: deque) -> bool:
        """STORE `batch` pipelined on `ws` (replies come in command order); False if the
        connection was lost before every reply arrived."""
        st = self.stats
        unanswered: list[PppEvent] = []
        try:
            for ev in batch:
                if ev.attempts:
                    st.retries += 1
                ev.attempts += 1
                unanswered.append(ev)
                self.in_flight += 1
                await ws.send({"cmd": "STORE", "event": ev.wrap})
            while unanswered:
                r = await ws.recv(30.0)
                if r.get("cmd") == "NOTIFY":
                    continue
                ev = unanswered.pop(0)
                self.in_flight -= 1
                self._outcome(ev, r, outbox)
            return True
        except (OSError, ConnectionClosed, asyncio.TimeoutError):
            st.lost += len(unanswered)
            for ev in unanswered:
                ev.maybe_landed = True
            return False
        finally:
            self.in_flight -= len(unanswered)

    def _outcome(self, ev: PppEvent, r: dict, outbox: deque) -> None:
        st = self.stats
        cmd, reason = r.get("cmd"), str(r.get("reason", ""))
        if cmd == "STORED":
            if r.get("event_id") != ev.eid:
                st.violations.append(f"STORED with another event id (sender {ev.sender})")
            ev.outcome = "stored"
        elif cmd == "STORE_FAIL" and reason.startswith("duplicate event"):
            st.refusals["duplicate event"] += 1
            if not ev.maybe_landed:
                st.violations.append("STORE_FAIL duplicate for an event that cannot have "
                                     "landed before (first attempt, or only refused ones)")
            ev.outcome = "duplicate"
        elif cmd == "STORE_FAIL" and reason.startswith(("rate limited", "storage unavailable")):
            st.refusals[reason.split(" (")[0]] += 1
            if reason.startswith("storage unavailable"):
                ev.maybe_landed = True        # the append failed: assume nothing either way
            return
        else:
            st.violations.append(f"unexpected STORE reply {cmd} {reason[:80]!r}")
            return
        outbox.remove(ev)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# -- cursor-sync devices -----------------------------------------------------------------------

ERR_INTERNAL, ERR_SHUTTING_DOWN, ERR_RATE_LIMITED = 3000, 3001, 2000
RETRYABLE = {ERR_INTERNAL, ERR_SHUTTING_DOWN, ERR_RATE_LIMITED}


class SyncLost(Exception):
    """The QUIC connection is gone (no PING answer, CONNECTION_CLOSE, timeout)."""


def sync_event_id(group: bytes, blob_id: bytes) -> bytes:
    """The relay's dedup key of a blob (README "cursor-sync"), recomputed here."""
    return hashlib.blake2b(group + blob_id, digest_size=32, person=b"0ksync.evt.v1").digest()


class SyncConn:
    """A SyncClient with a liveness watchdog: a SIGKILLed relay sends nothing over UDP, so
    the client PINGs every second and counts the connection lost when no ACK comes back (a
    real client's idle timeout, shortened)."""

    def __init__(self, c: SyncClient):
        self.c = c
        self.dead = asyncio.Event()
        self.watch = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while True:
                await asyncio.sleep(1.0)
                await asyncio.wait_for(self.c.proto.ping(), 5.0)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.dead.set()

    async def call(self, coro, timeout: float):
        task = asyncio.ensure_future(coro)
        if self.dead.is_set() or self.c.proto.terminated.done():
            task.cancel()
            raise SyncLost()
        dead = asyncio.ensure_future(self.dead.wait())
        try:
            done, _ = await asyncio.wait({task, dead}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if task in done:
            try:
                return task.result()
            except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
                raise SyncLost(type(exc).__name__) from None
        task.cancel()
        raise SyncLost("dead" if self.dead.is_set() else "timeout")

    async def request(self, body: bytes, timeout: float = 30.0):
        return await self.call(self.c.request(body), timeout)

    async def close(self) -> None:
        self.watch.cancel()
        try:
            await asyncio.wait_for(self.c.close(), 2.0)
        except (Exception, asyncio.TimeoutError):
            pass


@dataclass
class SyncBlob:
    group: int
    device: int
    blob_id: bytes
    payload: bytes
    attempts: int = 0
    maybe_landed: bool = False
    cursor: int | None = None          # from its PUSH_ACK


class SyncLoad:
    def __init__(self, port: int, seed: int):
        self.port = port
        rng = random.Random(seed + 1)
        self.seed = seed
        self.groups = [group_id(rng.randbytes(32)) for _ in range(SYNC_GROUPS)]
        self.devices = [(g, Device(rng.randbytes(32))) for g in range(SYNC_GROUPS)
                        for _ in range(SYNC_DEVICES)]
        self.blobs: list[SyncBlob] = []
        self.stats = LoadStats()
        self.in_flight = 0
        self.stop_producing = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    @property
    def acked(self) -> list[SyncBlob]:
        return [b for b in self.blobs if b.cursor is not None]

    @property
    def unacked(self) -> int:
        return sum(1 for b in self.blobs if b.cursor is None)

    async def open(self, d: int, admission: list | None = None) -> SyncConn:
        """Connect, authenticate, (join), HELLO v2; SyncLost if the relay is not there. A
        HELLO refused while the relay is up (membership lost?) is a violation."""
        g, dev = self.devices[d]
        group = self.groups[g]
        try:
            c = await asyncio.wait_for(SyncClient.connect(self.port), CONNECT_TIMEOUT)
        except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
            raise SyncLost(f"connect: {type(exc).__name__}") from None
        conn = SyncConn(c)
        try:
            got = await conn.call(c.authenticate(dev), 30.0)
            if got != ["Done", "AuthProof"]:
                self.stats.violations.append(f"auth answered {got!r}")
                raise SyncLost("auth")
            if admission is not None:
                got = await conn.request(join(group, *admission))
                assert got == ["Done", "Join"], got
            got = await conn.request(hello(2, f"dev{d}", group, 0))
            if not (isinstance(got, list) and got and got[0] == "Welcome"):
                if not (isinstance(got, list) and got[:2] == ["Error", ERR_SHUTTING_DOWN]):
                    self.stats.violations.append(f"HELLO of a member answered {got!r}")
                raise SyncLost("hello")
        except BaseException:
            await conn.close()
            raise
        return conn

    async def setup(self) -> None:
        """Each group: its first device creates it, the others are admitted by it."""
        exp = int(time.time()) + 86400
        for g in range(SYNC_GROUPS):
            members = [d for d, (gg, _) in enumerate(self.devices) if gg == g]
            first = self.devices[members[0]][1]
            conns = [await self.open(members[0])]
            for d in members[1:]:
                dev = self.devices[d][1]
                conns.append(await self.open(
                    d, [first.id, exp, first.admit(self.groups[g], dev.id, exp)]))
            for c in conns:
                await c.close()

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._device(d), name=f"sync-{d}")
                      for d in range(len(self.devices))]

    async def _device(self, d: int) -> None:
        rng = random.Random(self.seed * 1000 + 500 + d)
        g = self.devices[d][0]
        st = self.stats
        outbox: deque[SyncBlob] = deque()
        made = 0
        conn: SyncConn | None = None
        try:
            while True:
                if not outbox:
                    if self.stop_producing.is_set() or made >= MAX_PER_CLIENT:
                        return
                    await asyncio.sleep(rng.uniform(1.0, 3.0))
                    for _ in range(min(rng.choice([1, 2, 3, 4]), MAX_PER_CLIENT - made)):
                        b = SyncBlob(g, d, rng.randbytes(16),
                                     rng.randbytes(rng.choice([16, 200, 1000, 4000])))
                        self.blobs.append(b)
                        outbox.append(b)
                        made += 1
                if conn is None:
                    try:
                        conn = await self.open(d)
                        st.sessions += 1
                    except SyncLost:
                        st.connect_failures += 1
                        await asyncio.sleep(0.2)
                        continue
                batch = list(outbox)[:rng.choice([1, 2, 4])]
                results = await asyncio.gather(*(self._push(conn, b) for b in batch))
                for b in batch:
                    if b.cursor is not None:
                        outbox.remove(b)
                if "lost" in results:
                    await conn.close()
                    conn = None
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                elif "refused" in results:
                    await asyncio.sleep(rng.uniform(0.5, 2.0))
        finally:
            if conn is not None:
                await conn.close()

    async def _push(self, conn: SyncConn, b: SyncBlob) -> str:
        st = self.stats
        if b.attempts:
            st.retries += 1
        b.attempts += 1
        self.in_flight += 1
        try:
            r = await conn.request(push(b.blob_id, b.payload, 0), PUSH_TIMEOUT)
        except SyncLost:
            st.lost += 1
            b.maybe_landed = True
            return "lost"
        finally:
            self.in_flight -= 1
        return self._outcome(b, r)

    def _outcome(self, b: SyncBlob, r) -> str:
        st = self.stats
        if isinstance(r, list) and r[:1] == ["PushAck"] and len(r) == 3:
            if bytes(r[1]) != b.blob_id:
                st.violations.append("PUSH_ACK for another blob id")
                return "refused"
            if b.cursor is not None and r[2] != b.cursor:
                st.violations.append(f"re-push answered cursor {r[2]}, acked {b.cursor} before")
            b.cursor = r[2]
            return "acked"
        if isinstance(r, list) and r[:1] == ["Error"] and r[1] in RETRYABLE:
            st.refusals[f"Error {r[1]}"] += 1
            b.maybe_landed = b.maybe_landed or r[1] == ERR_INTERNAL
            return "refused"
        st.violations.append(f"unexpected PUSH reply {r!r:.100}")
        return "refused"

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# -- reads through the protocols ---------------------------------------------------------------

async def fetch_all(port: int, sk: SigningKey) -> list[bytes]:
    """Every GiftWrap FETCH returns to `sk`, page after page (duplicates kept)."""
    ws = await Ws.login(port, sk)
    try:
        out, cursor = [], None
        while True:
            req = {"cmd": "FETCH", "since": 0}
            if cursor is not None:
                req["cursor"] = cursor
            r = await ws.call(req)
            assert r.get("cmd") == "EVENTS", r
            out += r["events"]
            cursor = r.get("cursor")
            if cursor is None:
                return out
    finally:
        await ws.close()


async def pull_all(conn: SyncConn) -> list[tuple[bytes, int, bytes]]:
    """(blob_id, cursor, payload) of every blob PULL returns, page after page."""
    out, after = [], 0
    while True:
        r = await conn.request(pull(after, 1000))
        assert r and r[0] == "PullResponse", r
        out += [(bytes(e[0]), e[1], bytes(e[2])) for e in r[1]]
        if not r[2]:
            return out
        assert r[3] > after, r[2:]
        after = r[3]


# -- tables ------------------------------------------------------------------------------------

def read_table(path: Path, columns=None):
    return DeltaTable(str(path)).to_pyarrow_table(columns=columns)


def landing_rows(data: Path, columns: list[str]) -> list[dict]:
    """Rows of every landing table (every node, every generation)."""
    rows: list[dict] = []
    for gen in landing_generations(data):
        rows += read_table(gen, columns).to_pylist()
    return rows


def drained(data: Path) -> tuple[int, int, int]:
    tables = tables_dir(data)
    return (len(landing_rows(data, ["event_id"])), read_table(tables / "inbox", ["seq"]).num_rows,
            read_table(tables / "rejects", ["event_id"]).num_rows)


async def wait_for(cond, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


# -- the test ----------------------------------------------------------------------------------

def test_kill9_ppp_and_sync_acked_means_durable(relay):
    seed = int(os.environ.get("CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nCRASH_SEED={seed}", flush=True)
    try:
        report = asyncio.run(_scenario(relay, seed))
    except BaseException:
        print(f"\nFAILED with CRASH_SEED={seed}\n{relay.tails()}", flush=True)
        raise
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in report.items()), flush=True)


async def _pick_moment(role: str, targeted: bool, ppp: PppLoad, sync: SyncLoad,
                       data: Path) -> str:
    deadline = time.monotonic() + 8.0
    if role == "ingress":
        while not (ppp.in_flight and sync.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return f"{ppp.in_flight} STOREs, {sync.in_flight} PUSHes in flight"
    while not sync.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    if targeted:
        inbox = tables_dir(data) / "inbox"
        v0 = latest_commit(inbox)
        while latest_commit(inbox) == v0 and time.monotonic() < deadline + 10:
            await asyncio.sleep(0.002)
        return f"just after inbox commit {latest_commit(inbox)}, {sync.in_flight} PUSHes in flight"
    return f"{sync.in_flight} PUSHes in flight"


async def _scenario(relay: Relay, seed: int) -> dict:
    t_begin = time.monotonic()
    rng = random.Random(seed)
    procs = relay.procs
    for role in ROLES:
        procs[role].start()
    ready = await asyncio.gather(procs["ingress"].wait_ready(60),
                                 procs["stream"].wait_ready(STREAM_READY_TIMEOUT))
    log(f"roles ready (ingress {ready[0]:.1f}s, stream {ready[1]:.1f}s)")

    ppp = PppLoad(relay.ppp_port, seed)
    sync = SyncLoad(relay.sync_port, seed)
    await sync.setup()
    t0 = time.monotonic()
    ppp.start()
    sync.start()
    timeline: list[str] = []

    def note(msg: str) -> None:
        line = (f"t+{time.monotonic() - t0:5.1f}s {msg} (ppp stored {len(ppp.stored)}/"
                f"{len(ppp.events)}, sync acked {len(sync.acked)}/{len(sync.blobs)})")
        timeline.append(line)
        log(line)

    # -- chaos: ingress twice, the stream twice, seeded order and moments ----------------------
    # One ingress kill comes while the stream is down: its PUSHes (landed, waiting for their
    # cursor) and the STOREs acked meanwhile (landed, not yet in the inbox) are known to no
    # listener view after the restart, so their retries land again and the stream must drop
    # the copies.
    plan = ["ingress", "stream", "stream+ingress"]
    rng.shuffle(plan)
    restart_s: dict[str, list[float]] = defaultdict(list)
    ok = await wait_for(lambda: ppp.stored and sync.acked, 60, 0.1)
    assert ok, "no STORED and PUSH_ACK within 60 s of the start"

    async def kill(role: str, targeted: bool = False) -> None:
        moment = await _pick_moment(role, targeted, ppp, sync, relay.data)
        procs[role].kill9()
        note(f"kill -9 {role} ({moment})")

    async def restart(role: str) -> None:
        await asyncio.sleep(rng.uniform(0.3, 2.0))
        procs[role].start()
        took = await procs[role].wait_ready(STREAM_READY_TIMEOUT if role == "stream" else 60)
        restart_s[role].append(round(took, 1))
        note(f"{role} back after {took:.1f}s")

    for step in plan:
        await asyncio.sleep(rng.uniform(2.0, 6.0))
        if step == "ingress":
            await kill("ingress")
            await restart("ingress")
        else:
            await kill("stream", targeted=step == "stream")
            if step == "stream+ingress":
                await asyncio.sleep(rng.uniform(1.0, 3.0))
                await kill("ingress")
                await restart("ingress")
            await restart("stream")
        # The next kill hits a working relay: PUSH_ACKs (which need both roles) flow again.
        acked = len(sync.acked)
        ok = await wait_for(lambda: len(sync.acked) > acked, 90, 0.1)
        assert ok, f"no PUSH_ACK within 90 s of the restart ({step})"
        note("PUSH_ACKs flowing again")

    # -- settle: every event stored, every blob acked ------------------------------------------
    ppp.stop_producing.set()
    sync.stop_producing.set()
    ok = await wait_for(lambda: ppp.unstored == 0 and sync.unacked == 0, SETTLE_DEADLINE)
    note("all stored / acked" if ok else "settle deadline passed")
    await ppp.close()
    await sync.close()
    assert ok, f"{ppp.unstored} PPP events never stored, {sync.unacked} blobs never acked"
    assert not ppp.stats.violations, ppp.stats.violations[:10]
    assert not sync.stats.violations, sync.stats.violations[:10]

    # -- reads through the protocols: the live views, then views rebuilt from the inbox --------
    checks = {}
    await _check_reads(relay, ppp, sync, "live")
    code = await procs["ingress"].term(60)
    assert code == 0, f"ingress exit {code} on SIGTERM"
    procs["ingress"].start()
    await procs["ingress"].wait_ready(60)
    note("ingress restarted cleanly")
    await _check_reads(relay, ppp, sync, "rebuilt")
    checks["retries after restart"] = await _retry_everything(relay, ppp, sync)
    note("re-STORE / re-PUSH of everything answered")

    ok = await wait_for(lambda: (lambda c: c[0] == c[1] + c[2])(drained(relay.data)), 60, 1.0)
    assert ok, "landing != inbox + rejects: the stream did not drain"
    exit_codes = {role: await procs[role].term(90) for role in ("ingress", "stream")}
    note(f"stopped: {exit_codes}")
    assert exit_codes == {"ingress": 0, "stream": 0}, exit_codes
    checks.update(_check_tables(relay.data, ppp, sync))

    ps, ss = ppp.stats, sync.stats
    return {
        "seed": seed,
        "plan": plan,
        "ppp events (senders, recipients)": f"{len(ppp.events)} ({PPP_SENDERS}, {PPP_RECIPIENTS})",
        "ppp events answered STORED / duplicate (a retry)":
            f"{sum(e.outcome == 'stored' for e in ppp.events)} / "
            f"{sum(e.outcome == 'duplicate' for e in ppp.events)}",
        "ppp sessions, connect failures, lost replies, retries":
            (ps.sessions, ps.connect_failures, ps.lost, ps.retries),
        "ppp refusals": dict(ps.refusals),
        "sync blobs (groups x devices)": f"{len(sync.blobs)} ({SYNC_GROUPS} x {SYNC_DEVICES})",
        "sync sessions, connect failures, lost replies, retries":
            (ss.sessions, ss.connect_failures, ss.lost, ss.retries),
        "sync refusals": dict(ss.refusals),
        **checks,
        "restart-to-ready seconds": dict(restart_s),
        "stream batches replayed and skipped":
            procs["stream"].stderr_path.read_text(errors="replace")
            .count("stream_batch_replay_skipped"),
        "total seconds": round(time.monotonic() - t_begin, 1),
        "timeline": "\n    " + "\n    ".join(timeline),
    }


async def _check_reads(relay: Relay, ppp: PppLoad, sync: SyncLoad, view: str) -> None:
    # PPP: FETCH returns each stored event to its recipient exactly once, and nothing else.
    for r, sk in enumerate(ppp.recipients):
        expected = {e.eid: e.wrap for e in ppp.events if e.recipient == r}
        assert all(e.outcome for e in ppp.events if e.recipient == r)
        got: list[bytes] = []

        async def complete() -> bool:
            nonlocal got
            got = await fetch_all(relay.ppp_port, sk)
            return {wrap_id(w) for w in got} >= expected.keys()
        deadline = time.monotonic() + 60
        while not await complete():
            assert time.monotonic() < deadline, \
                f"{view}: recipient {r}: {len(expected.keys() - {wrap_id(w) for w in got})} " \
                f"stored events not returned by FETCH"
            await asyncio.sleep(2.5)      # FETCH budget: 30 / min
        ids = Counter(wrap_id(w) for w in got)
        twice = [i for i, n in ids.items() if n > 1]
        assert not twice, f"{view}: recipient {r}: {len(twice)} events returned twice by FETCH"
        phantom = [w for w in got if expected.get(wrap_id(w)) != w]
        assert not phantom, f"{view}: recipient {r}: FETCH returned {len(phantom)} events " \
                            f"nobody stored for it"
    # cursor-sync: PULL returns every acked blob at its acked cursor; cursors 1..n per group.
    for g in range(SYNC_GROUPS):
        d = next(i for i, (gg, _) in enumerate(sync.devices) if gg == g)
        expected = {b.blob_id: b for b in sync.blobs if b.group == g}
        got: list[tuple[bytes, int, bytes]] = []
        deadline = time.monotonic() + 60
        while True:
            conn = await sync.open(d)
            try:
                got = await pull_all(conn)
            finally:
                await conn.close()
            if len(got) >= len(expected) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        by_id = {bid: (cur, payload) for bid, cur, payload in got}
        assert len(by_id) == len(got), f"{view}: group {g}: a blob id pulled twice"
        assert by_id.keys() == expected.keys(), \
            f"{view}: group {g}: pulled {len(by_id)} blobs, pushed {len(expected)} " \
            f"(missing {len(expected.keys() - by_id.keys())}, " \
            f"phantom {len(by_id.keys() - expected.keys())})"
        for bid, b in expected.items():
            assert by_id[bid] == (b.cursor, b.payload), \
                f"{view}: group {g}: blob acked at cursor {b.cursor} pulled at " \
                f"{by_id[bid][0]} (or with another payload)"
        assert sorted(c for c, _ in by_id.values()) == list(range(1, len(by_id) + 1)), \
            f"{view}: group {g}: cursors are not 1..{len(by_id)}"


async def _retry_everything(relay: Relay, ppp: PppLoad, sync: SyncLoad) -> dict:
    """After the drain and a restart: each sender's first RESTORE_SAMPLE events STOREd again
    answer duplicate (or STORED), every blob pushed again answers its acked cursor."""
    replies: Counter = Counter()
    for i, sk in enumerate(ppp.senders):
        mine = [e for e in ppp.events if e.sender == i][:RESTORE_SAMPLE]
        ws = await Ws.login(relay.ppp_port, sk)
        try:
            for e in mine:
                await ws.send({"cmd": "STORE", "event": e.wrap})
            for e in mine:
                r = await ws.recv()
                reason = str(r.get("reason", ""))
                assert r == {"cmd": "STORED", "event_id": e.eid} or (
                    r.get("cmd") == "STORE_FAIL" and reason.startswith("duplicate event")), r
                replies["ppp " + (r["cmd"] if r["cmd"] == "STORED" else "duplicate")] += 1
        finally:
            await ws.close()
    for d in range(len(sync.devices)):
        mine = [b for b in sync.blobs if b.device == d]
        conn = await sync.open(d)
        try:
            for k in range(0, len(mine), 8):
                got = await asyncio.gather(*(conn.request(push(b.blob_id, b.payload, 0))
                                             for b in mine[k:k + 8]))
                for b, r in zip(mine[k:k + 8], got):
                    assert r == ["PushAck", b.blob_id, b.cursor], \
                        f"re-push of a blob acked at {b.cursor} answered {r!r:.80}"
                    replies["sync same cursor"] += 1
        finally:
            await conn.close()
    return dict(replies)


def _check_tables(data: Path, ppp: PppLoad, sync: SyncLoad) -> dict:
    tables = tables_dir(data)
    landed = landing_rows(data, ["event_id", "protocol", "mailbox", "envelope"])
    inbox = read_table(tables / "inbox").to_pylist()
    rejects = read_table(tables / "rejects", ["event_id", "reason"]).to_pylist()

    # landing = inbox + duplicate rejects; every inbox / landing row was sent by a client
    assert len(landed) == len(inbox) + len(rejects), (len(landed), len(inbox), len(rejects))
    assert {r["reason"] for r in rejects} <= {"duplicate"}, Counter(r["reason"] for r in rejects)
    ids = Counter(r["event_id"] for r in inbox)
    assert not [i for i, n in ids.items() if n > 1], "an event_id is in the inbox twice"
    assert {r["event_id"] for r in landed} == ids.keys()
    assert len(rejects) == sum(n - 1 for n in Counter(r["event_id"] for r in landed).values())

    ppp_by_id = {e.eid: e for e in ppp.events}
    recipients = [bytes(sk.verify_key) for sk in ppp.recipients]
    sync_by_id = {sync_event_id(sync.groups[b.group], b.blob_id): b for b in sync.blobs}
    per_box: dict[tuple, list[int]] = defaultdict(list)
    for r in inbox:
        if r["protocol"] == "ppp":
            e = ppp_by_id.get(r["event_id"])
            assert e is not None, "a ppp inbox row nobody STOREd (phantom)"
            assert r["envelope"] == e.wrap and r["mailbox"] == recipients[e.recipient]
        elif r["protocol"] == "sync":
            b = sync_by_id.get(r["event_id"])
            assert b is not None, "a sync inbox row nobody PUSHed (phantom)"
            assert r["envelope"] == b.payload and r["mailbox"] == sync.groups[b.group]
            assert r["cursor"] == b.cursor, "inbox cursor != the PUSH_ACKed cursor"
        else:
            raise AssertionError(f"inbox row of protocol {r['protocol']}")
        per_box[(r["protocol"], r["mailbox"])].append(r["cursor"])
    for (proto, box), cursors in per_box.items():
        assert sorted(cursors) == list(range(1, len(cursors) + 1)), \
            f"{proto} mailbox {box[:4].hex()}: cursors not gap-free 1..{len(cursors)}"
    assert {r["event_id"] for r in inbox if r["protocol"] == "ppp"} == ppp_by_id.keys()
    assert {r["event_id"] for r in inbox if r["protocol"] == "sync"} == sync_by_id.keys()
    return {"landing rows": len(landed), "inbox rows": len(inbox),
            "duplicates dropped by the stream": len(rejects),
            "max cursor per mailbox": sorted(len(c) for c in per_box.values())}
