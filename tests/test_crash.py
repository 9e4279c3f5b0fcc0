"""Crash test: kill -9 ingress, the stream and egress (separately) at random moments during a few
thousand pushes; after restart every acked envelope is delivered, no cursor is duplicated or
skipped, and nothing unacked is reported as acked. Plus: ingress and egress killed in the
middle of the live path's hand-off (issue 20), and SIGTERM of ingress with pushes in flight
loses no acked push.

Run: `.venv/bin/pytest -m crash tests/test_crash.py -s` (excluded by the default addopts).
Knobs (environment): CRASH_SEED, CRASH_PUSHES (3000), CRASH_LOAD_SECONDS (150),
CRASH_ROUNDS (2), CRASH_WORKERS (6), CRASH_MAILBOXES (4).

Every role is a real `python -m relay.cli <role>` process on fixed ports and one data dir;
a kill is SIGKILL of the role's whole process tree (for the stream: the Python driver, its JVM
and the Python workers), then a restart with the same command after a short random pause.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from deltalake import DeltaTable

from crash_harness import (REPO, PushLoad, Receivers, RelayProcesses, envelope_uid,
                           landing_generations, latest_commit, log, tables_dir)
from egress.pending import EARLY_BASE

pytestmark = pytest.mark.crash

ROLES = ("ingress", "stream", "egress")
PUSHES = int(os.environ.get("CRASH_PUSHES", "3000"))
LOAD_SECONDS = float(os.environ.get("CRASH_LOAD_SECONDS", "150"))
ROUNDS = int(os.environ.get("CRASH_ROUNDS", "2"))
WORKERS = int(os.environ.get("CRASH_WORKERS", "6"))
MAILBOXES = int(os.environ.get("CRASH_MAILBOXES", "4"))
STREAM_READY_TIMEOUT = 240.0
ACK_DEADLINE = 120.0        # after the load: every envelope acked by then (retries included)
DELIVERY_DEADLINE = 120.0   # then: every acked envelope delivered by then

# Small per-mailbox memory in egress, so a restart after a backlog pages from Delta.
CONF = """
[egress]
max_pending_per_mailbox = 64
"""


class Relay(RelayProcesses):
    def __init__(self, tmp_path: Path, s3_endpoint: str | None = None):
        super().__init__(tmp_path, CONF, ROLES, s3_endpoint)
        self.push_port = self.ports["RELAY_TRUESEAL_PUSH_PORT"]
        self.receive_port = self.ports["RELAY_TRUESEAL_RECEIVE_PORT"]

    def relay_pub(self) -> bytes:
        out = subprocess.run([sys.executable, "-m", "relay.cli", *self.prefix, "keys"],
                             cwd=REPO, env=self.env, capture_output=True, text=True, check=True)
        keys = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return bytes.fromhex(keys["trueseal"])


@pytest.fixture
def relay(tmp_path, s3_endpoint):
    r = Relay(tmp_path, s3_endpoint)
    log(f"data dir {r.data}, push :{r.push_port}, receive :{r.receive_port}")
    try:
        yield r
    finally:
        r.cleanup()


# -- table readers -----------------------------------------------------------------------------

def read_table(path: Path, columns=None):
    return DeltaTable(str(path)).to_pyarrow_table(columns=columns)


def landing_rows(data: Path) -> list[tuple[bytes, bytes]]:
    """(mailbox, envelope) of every landing row, over every node and generation."""
    rows = []
    for gen in landing_generations(data):
        t = read_table(gen, ["mailbox", "envelope"])
        rows += zip(t.column("mailbox").to_pylist(), t.column("envelope").to_pylist())
    return rows


def trueseal_event_id(recipient: bytes, envelope: bytes) -> bytes:
    """DESIGN.md / engine.trueseal.ids, recomputed here from the definition."""
    h = hashlib.blake2b(digest_size=32, person=b"trueseal.evt.v1")
    h.update(recipient)
    h.update(envelope)
    return h.digest()


async def wait_for(cond, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)


async def pick_moment(role: str, targeted: bool, load: PushLoad, receivers: Receivers,
                      data: Path, rng: random.Random) -> str:
    if role == "ingress":
        deadline = time.monotonic() + 5.0
        while load.in_flight == 0 and time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(0.0, 0.01))
        return "pushes in flight" if load.in_flight else "random"
    if not targeted:
        return "random"
    if role == "stream":
        inbox = tables_dir(data) / "inbox"
        v0 = latest_commit(inbox)
        deadline = time.monotonic() + 10.0
        while latest_commit(inbox) == v0 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return f"just after inbox commit {latest_commit(inbox)}"
    # egress: just after a Deliver that came before its inbox row, when it can (its
    # DeliverAck then waits in egress's memory for the row, and dies with the process)
    for event, what in ((receivers.delivered_early, "an early Deliver"),
                        (receivers.delivered, "a Deliver")):
        event.clear()
        try:
            await asyncio.wait_for(event.wait(), 10.0)
            return f"just after {what}"
        except asyncio.TimeoutError:
            continue
    return "random (no Deliver within 20s)"


# -- the crash test ----------------------------------------------------------------------------

def test_kill9_each_role_during_load(relay):
    _run_crash(relay, ROLES, PUSHES, LOAD_SECONDS, ROUNDS, targeted_every_round=False)


def test_kill9_ingress_and_egress_mid_handoff(relay):
    """Issue 20's live path under kills: receivers are online, so most pushes reach them
    from ingress's hand-off before their inbox rows. Egress is killed just after such a
    Deliver (its DeliverAck waits in memory for the row and is lost: the row is delivered
    again after the restart), ingress with pushes in flight (committed, handed off or not,
    acked or not). Every acked envelope is still delivered, never twice in a session, and
    every inbox row gets its ack row."""
    report = _run_crash(relay, ("ingress", "egress"), PUSHES // 2, LOAD_SECONDS / 2, 3,
                        targeted_every_round=True)
    assert report["of which before their inbox row (ingress's hand-off)"] > 0


def _run_crash(relay: Relay, roles: tuple[str, ...], pushes: int, load_seconds: float,
               rounds: int, targeted_every_round: bool) -> dict:
    seed = int(os.environ.get("CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nCRASH_SEED={seed}  pushes={pushes} load={load_seconds}s rounds={rounds} "
          f"workers={WORKERS} mailboxes={MAILBOXES} kills={roles}", flush=True)
    try:
        report = asyncio.run(_crash_scenario(relay, seed, roles, pushes, load_seconds, rounds,
                                             targeted_every_round))
    except BaseException:
        print(f"\nFAILED with CRASH_SEED={seed}\n{relay.tails()}", flush=True)
        raise
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in report.items()), flush=True)
    return report


async def _crash_scenario(relay: Relay, seed: int, roles: tuple[str, ...], pushes: int,
                          load_seconds: float, rounds: int, targeted_every_round: bool) -> dict:
    t_begin = time.monotonic()
    rng = random.Random(seed)
    procs = relay.procs
    relay_pub = relay.relay_pub()          # creates the key before the roles race for it
    for role in ("ingress", "egress", "stream"):
        procs[role].start()
    ready = await asyncio.gather(procs["ingress"].wait_ready(60), procs["egress"].wait_ready(60),
                                 procs["stream"].wait_ready(STREAM_READY_TIMEOUT))
    log(f"all roles ready (ingress {ready[0]:.1f}s, egress {ready[1]:.1f}s, "
        f"stream {ready[2]:.1f}s)")

    receivers = Receivers(relay.receive_port, relay_pub, MAILBOXES)
    receivers.start()
    load = PushLoad(relay.push_port, relay_pub, receivers.mailboxes, pushes, load_seconds,
                    WORKERS, seed)
    load.start()
    events: list[str] = []

    def note(msg: str) -> None:
        line = f"t+{time.monotonic() - load.t0:6.1f}s {msg} (produced {load.produced}, " \
               f"acked {len(load.acked)}, delivered {len(receivers.delivered_uids)})"
        events.append(line)
        log(line)

    # -- chaos: each role separately, at a random moment, then restarted -----------------------
    restart_times: dict[str, list[float]] = defaultdict(list)
    orphan_tasks: list[asyncio.Task] = []
    last_kill_by = load_seconds - 5      # every kill happens while pushes are still produced
    for rnd in range(rounds):
        order = list(roles)
        rng.shuffle(order)
        for role in order:
            await asyncio.sleep(rng.uniform(2.0, 10.0))
            if time.monotonic() - load.t0 > last_kill_by:
                note(f"round {rnd + 1}: no time left to kill {role}")
                continue
            # Random moments, nudged towards the windows that matter: ingress with Pushes
            # under way (their Acks are lost, the retries land as duplicates); in rounds 1, 3..
            # the stream just after an inbox commit (before Spark's commit log: the batch is
            # replayed and must be skipped) and egress just after a Deliver (before its
            # DeliverAck is durable: redelivered in the next session). Bounded waits.
            targeted = targeted_every_round or rnd % 2 == 0
            moment = await pick_moment(role, targeted, load, receivers, relay.data, rng)
            note(f"round {rnd + 1}: kill -9 {role} ({moment}), "
                 f"{load.in_flight} pushes in flight")
            # The stream's kills: the whole tree (driver, JVM, workers) in targeted rounds,
            # in the others the driver process alone, its JVM still exiting at the restart.
            whole_tree = targeted or role != "stream"
            procs[role].kill9(whole_tree=whole_tree)
            if not whole_tree:
                orphan_tasks.append(asyncio.create_task(procs[role].reap_orphans()))
                note(f"round {rnd + 1}: killed the stream's driver only; its JVM is left")
            await asyncio.sleep(rng.uniform(0.3, 2.5))
            procs[role].start()
            took = await procs[role].wait_ready(STREAM_READY_TIMEOUT if role == "stream" else 60)
            restart_times[role].append(round(took, 1))
            note(f"round {rnd + 1}: {role} back after {took:.1f}s")
            # Ready is not yet working (the stream's first batch warms up Python workers):
            # the next kill comes once deliveries flow again, so it hits a busy relay.
            before = len(receivers.deliveries)
            await wait_for(lambda: len(receivers.deliveries) > before
                           or load.producer_done.is_set(), 90, 0.1)
            note(f"round {rnd + 1}: deliveries flowing again")

    orphan_exit = [await t for t in orphan_tasks]
    assert None not in orphan_exit, "the stream's JVM outlived its killed driver by 30 s"

    # Clean shutdown of ingress with pushes in flight: afterwards, every acked push is landed.
    await asyncio.sleep(rng.uniform(1.0, 4.0))
    clean_check = "skipped (load over)"
    if not load.producer_done.is_set():
        await pick_moment("ingress", True, load, receivers, relay.data, rng)
        note(f"SIGTERM ingress, {load.in_flight} pushes in flight")
        code = await procs["ingress"].term(30)
        assert code == 0, f"ingress did not stop cleanly on SIGTERM: exit {code}"
        acked_at_stop = set(load.acked)      # ingress is gone: no Ack can arrive any more
        landed = {envelope_uid(e) for _m, e in await asyncio.to_thread(landing_rows, relay.data)}
        missing = acked_at_stop - landed
        assert not missing, f"{len(missing)} acked pushes not in landing after SIGTERM"
        clean_check = (f"ok: exit 0 after {procs['ingress'].last_stop_seconds}s, "
                       f"{len(acked_at_stop)} acked pushes all in landing")
        note(f"ingress stopped cleanly; {clean_check}")
        procs["ingress"].start()
        await procs["ingress"].wait_ready(60)
        note("ingress back")

    # -- end: finish the load and every retry, then every delivery ------------------------------
    await load.producer_done.wait()
    note("load produced")
    ok = await wait_for(lambda: load.unacked == 0, ACK_DEADLINE)
    note("all acked" if ok else "ack deadline passed")
    await load.close()
    assert ok, f"{load.unacked} envelopes never acked within {ACK_DEADLINE}s of retries"
    t_acked = time.monotonic()
    acked = set(load.acked)

    ok = await wait_for(lambda: acked <= receivers.delivered_uids.keys(), DELIVERY_DEADLINE)
    note("all acked envelopes delivered" if ok else "delivery deadline passed")
    undelivered = acked - receivers.delivered_uids.keys()
    assert ok, f"{len(undelivered)} acked envelopes not delivered, e.g. {sorted(undelivered)[:10]}"
    drain_seconds = time.monotonic() - t_acked

    # The stream has consumed everything in landing once landing = inbox + rejects.
    data = relay.data
    tables = tables_dir(data)

    def counts() -> tuple[int, int, int]:
        return (len(landing_rows(data)), read_table(tables / "inbox", ["seq"]).num_rows,
                read_table(tables / "rejects", ["event_id"]).num_rows)
    deadline = time.monotonic() + 60
    while (c := await asyncio.to_thread(counts))[0] != c[1] + c[2]:
        assert time.monotonic() < deadline, f"landing {c[0]} != inbox {c[1]} + rejects {c[2]}"
        await asyncio.sleep(1.0)
    # Durable DeliverAcks: every delivered envelope's ack row reaches `acks`.
    ok_acks = await wait_for(
        lambda: read_table(tables / "acks", ["seq"]).num_rows >= len(acked), 30, 1.0)
    await asyncio.sleep(1.0)
    await receivers.close()

    # Graceful stop of every role (ingress first, as `relay up` does).
    exit_codes, stop_seconds = {}, {}
    for role in ("ingress", "stream", "egress"):
        exit_codes[role] = await procs[role].term(90)
        stop_seconds[role] = procs[role].last_stop_seconds
    note(f"stopped: exit codes {exit_codes}, seconds {stop_seconds}")

    # -- checks ---------------------------------------------------------------------------------
    sent = load.sent
    mailboxes = receivers.mailboxes
    inbox = read_table(tables / "inbox")
    rejects = read_table(tables / "rejects")
    acks_t = read_table(tables / "acks")
    landed = landing_rows(data)

    # (3a) every envelope in landing / inbox was sent by a client: no phantom rows
    for m, env in landed:
        uid = envelope_uid(env)
        assert uid in sent and sent[uid][1] == env and mailboxes[sent[uid][0]] == m, \
            "landing holds an envelope no client sent"
    rows = inbox.to_pylist()
    by_uid = {}
    for r in rows:
        uid = envelope_uid(r["envelope"] or b"")
        assert uid in sent, "inbox holds an envelope no client sent"
        mb, env = sent[uid]
        assert r["envelope"] == env and r["mailbox"] == mailboxes[mb] and r["protocol"] == "trueseal"
        assert r["event_id"] == trueseal_event_id(r["mailbox"], env)
        assert uid not in by_uid, f"envelope {uid} is in the inbox twice"
        by_uid[uid] = r

    # (2) each event_id once; per (protocol, mailbox) cursors exactly 1..n; seqs unique
    ids = inbox.column("event_id").to_pylist()
    dup_ids = [e for e, n in Counter(ids).items() if n > 1]
    assert not dup_ids, f"{len(dup_ids)} event_ids in the inbox more than once"
    per_box: dict[tuple, list[int]] = defaultdict(list)
    for r in rows:
        per_box[(r["protocol"], r["mailbox"])].append(r["cursor"])
    for key, cursors in per_box.items():
        cs = sorted(cursors)
        dups = [c for c, n in Counter(cs).items() if n > 1]
        gaps = sorted(set(range(1, len(cs) + 1)) - set(cs))
        assert cs == list(range(1, len(cs) + 1)), \
            f"mailbox {key[1][:4].hex()}: duplicated cursors {dups[:10]}, gaps {gaps[:10]}"
    seqs = inbox.column("seq").to_pylist()
    assert len(seqs) == len(set(seqs)), "a seq (blob_id) was assigned twice"
    # cursors follow seq order within a mailbox (FIFO)
    for key in per_box:
        pairs = sorted((r["seq"], r["cursor"]) for r in rows
                       if (r["protocol"], r["mailbox"]) == key)
        assert [c for _s, c in pairs] == sorted(c for _s, c in pairs), "cursor order != seq order"

    # (3b) nothing unacked reported as acked: every acked envelope is in the inbox ...
    not_in_inbox = acked - by_uid.keys()
    assert not not_in_inbox, f"{len(not_in_inbox)} acked envelopes missing from the inbox"
    # ... and nothing else is (every envelope sent was acked in the end)
    assert by_uid.keys() == set(sent) == acked
    # landing = inbox + rejected duplicates, each landing row processed exactly once
    landed_uids = Counter(envelope_uid(e) for _m, e in landed)
    assert set(landed_uids) == by_uid.keys()
    reasons = Counter(rejects.column("reason").to_pylist())
    assert set(reasons) <= {"duplicate"}, reasons
    assert len(landed) == len(rows) + rejects.num_rows, \
        f"landing {len(landed)} != inbox {len(rows)} + rejects {rejects.num_rows}"
    assert rejects.num_rows == sum(n - 1 for n in landed_uids.values())

    # (1) every acked envelope delivered at least once; deliveries are exactly the inbox rows
    # (by seq, or for one delivered before its row under a provisional id, by its envelope)
    seq_row = {r["seq"]: r for r in rows}
    for d in receivers.deliveries:
        r = by_uid.get(envelope_uid(d.envelope)) if d.blob_id >= EARLY_BASE \
            else seq_row.get(d.blob_id)
        assert r is not None, f"delivered blob_id {d.blob_id} is not an inbox row"
        assert r["envelope"] == d.envelope and r["mailbox"] == mailboxes[d.mailbox], \
            f"blob {d.blob_id} delivered with the wrong envelope or to the wrong mailbox"
    delivered = receivers.delivered_uids
    assert acked <= delivered.keys()
    duplicates = sum(n - 1 for n in delivered.values())

    # (4) within one receive session no blob_id twice; and in cursor order
    rs = receivers.stats
    assert not rs.in_session_duplicates, f"blob delivered twice in a session: " \
                                         f"{rs.in_session_duplicates[:10]}"
    assert not rs.out_of_order, f"deliveries out of order in a session: {rs.out_of_order[:10]}"
    assert not rs.violations and not load.stats.violations, (rs.violations, load.stats.violations)
    assert not rs.unexpected_frames and not load.stats.unexpected_frames
    assert load.stats.reply_timeouts == 0, "the relay held a Push without a reply for 30 s"

    # acks: one row per delivered envelope, none for anything else
    ack_seqs = acks_t.column("seq").to_pylist()
    assert ok_acks and set(ack_seqs) == set(seqs), \
        f"acks cover {len(set(ack_seqs) & set(seqs))} of {len(seqs)} inbox seqs"

    for role, code in exit_codes.items():
        assert code == 0, f"{role} exit code {code} on SIGTERM"
    stragglers = {r: p.stragglers for r, p in procs.items() if p.stragglers}
    assert not stragglers, f"processes outlived their role by 15 s: {stragglers}"

    logs = {r: p.stderr_path.read_text(errors="replace") for r, p in procs.items()}
    error_lines = {r: sum('"level": "error"' in ln or '"level": "critical"' in ln
                          for ln in text.splitlines()) for r, text in logs.items()}
    ps = load.stats
    return {
        "seed": seed,
        "pushes (unique envelopes)": len(sent),
        "push sessions": ps.sessions,
        "push frames sent (incl. retries)": ps.pushes_sent,
        "retried pushes": ps.retries,
        "Error replies": ps.errors,
        "connect failures (role down)": ps.connect_failures,
        "sessions lost before all replies": ps.lost_sessions,
        "landing rows": len(landed),
        "duplicates dropped by the stream": rejects.num_rows,
        "inbox rows": len(rows),
        "acks rows (distinct seqs)": f"{acks_t.num_rows} ({len(set(ack_seqs))})",
        "mailboxes / max cursor": {k[1][:4].hex(): len(v) for k, v in per_box.items()},
        "deliveries": len(receivers.deliveries),
        "of which before their inbox row (ingress's hand-off)": rs.early,
        "redeliveries across sessions": duplicates,
        "receive sessions": rs.sessions,
        "heartbeats echoed": rs.heartbeats,
        "kills": {r: p.kills for r, p in relay.procs.items()},
        "restart-to-ready seconds": dict(restart_times),
        "stream batches replayed and skipped": logs["stream"].count("stream_batch_replay_skipped"),
        "error-level log lines": error_lines,
        "orphaned JVM gone after driver-only kill (s)": [round(x, 1) for x in orphan_exit],
        "clean ingress stop": clean_check,
        "exit codes on final SIGTERM": exit_codes,
        "seconds to stop on final SIGTERM": stop_seconds,
        "drain after last ack (s)": round(drain_seconds, 1),
        "total seconds": round(time.monotonic() - t_begin, 1),
        "timeline": "\n    " + "\n    ".join(events),
    }


# -- clean shutdown, ingress only --------------------------------------------------------------

def test_sigterm_ingress_keeps_every_acked_push(relay):
    """SIGTERM ingress while pushes are in flight (many pipelined sessions): the process stops
    cleanly and every push it acked is in its landing table."""
    seed = int(os.environ.get("CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nCRASH_SEED={seed}", flush=True)
    try:
        report = asyncio.run(_sigterm_scenario(relay, seed))
    except BaseException:
        print(f"\nFAILED with CRASH_SEED={seed}\n{relay.tails()}", flush=True)
        raise
    print("  " + str(report), flush=True)


async def _sigterm_scenario(relay: Relay, seed: int) -> dict:
    rng = random.Random(seed)
    ingress = relay.procs["ingress"]
    relay_pub = relay.relay_pub()
    ingress.start()
    await ingress.wait_ready(60)
    # 8 mailboxes nobody reads; fast load: 20,000 envelopes offered over 10 s
    mailboxes = [os.urandom(32) for _ in range(8)]
    load = PushLoad(relay.push_port, relay_pub, mailboxes, 20000, 10.0, 16, seed)
    load.start()
    await asyncio.sleep(rng.uniform(1.5, 4.0))
    in_flight = load.produced - len(load.acked)
    code = await ingress.term(30)
    acked = set(load.acked)
    await load.close()
    assert code == 0, f"ingress exit code {code} on SIGTERM"
    landed = landing_rows(relay.data)
    uids = {envelope_uid(e) for _m, e in landed}
    missing = acked - uids
    assert not missing, f"{len(missing)} acked pushes are not in landing"
    for m, env in landed:
        uid = envelope_uid(env)
        assert uid in load.sent and load.sent[uid][1] == env and mailboxes[load.sent[uid][0]] == m
    return {"acked": len(acked), "landed": len(landed), "unacked but landed": len(uids - acked),
            "produced, not yet acked at SIGTERM": in_flight}
