"""A realistic synthetic day in a data directory, so the notebooks and `relay status` have
something true to show (`relay loadgen`).

What one day holds at `scale=1` (volumes scale linearly, mailbox counts with its square root):

* ~20,000 pushes over 24 h on a diurnal curve (quiet around 04:00 UTC, a mid-day and an
  evening peak), arriving in ~480 bursts of a conversation's worth within a second, which
  ingress group-commits into one landing commit each;
* three protocols, each with its own rules for ids and expiry:
  - trueseal (60 %): event id = BLAKE2b(recipient ‖ envelope), so a retry is a duplicate;
    the relay sets the TTL (`trueseal.ttl_seconds`, 30 days);
  - heya (30 %): one event id per SEND (engine/heya/ids.py), so a retry is stored again as a
    new message; the relay sets the TTL (`heya.ttl_seconds`). Its mailboxes are send tokens,
    minted through the Heya control plane (`delta_tables.heya_control`: inbox token, INCO, AUTH)
    for one registered mailbox per two or three tokens, so compaction sees them as live;
  - ppp (10 %): rows of a protocol whose *sender* sets the expiry (1 h to 7 days; 1 % arrive
    already expired and are rejected by the stream). This relay does not serve PPP yet; its
    rows are what makes TTL expiry visible within one day, since nothing with a 30-day TTL
    expires in a day;
* PPP rooms (spec 004 §7): ~40 rooms around six European cities, each living 2 h to 3 days,
  created through the PPP control plane (`delta_tables.ppp_control`) at their simulated
  time, and ~1,500 room messages (protocol `ppp_room`, Zipf over the rooms, within each
  room's life); room messages are never acked (they leave with their room's expiry);
* 2,000 mailboxes, Zipf-skewed (s = 1.1): a few mailboxes get most of the traffic;
* sizes padded to the buckets 256 / 1024 / 4096 / 16384 (55 / 28 / 10 / 4 %), 3 % unpadded;
* 3 % client retries of an envelope that already landed, seconds to minutes later;
* acks by device behaviour: most devices are online and ack within a second, the rest when
  they reconnect hours later; 5 % of mailboxes stay dormant all day (their ppp envelopes
  expire undelivered, the others stay pending).

How it is built. Landing rows are committed with the ingress appender (`LandingTarget`), and
each landing commit is run at once through the stream's own foreachBatch function
(`jobs.inbox_stream.InboxSink`: the same transform, dedup, cursors, TTL clamp, rejects, padding
audit and exactly-once Delta commits) as one micro-batch stamped with its simulated time. Not
through Spark: Spark would stamp every micro-batch with the wall clock of the generator's run,
hours after each envelope's simulated receipt, and commit latency, inbox depth and expiry would
all be false. Acks are appended to `acks` with egress's schema at their simulated times.

At the end the day's landing generations are sealed (a new, empty generation is started),
recorded as consumed as the stream's source records them, and dropped as compaction drops
them. A relay stream started later on this directory begins after the day (its dedup and
cursors continue from the inbox) instead of re-reading the day as duplicates. Compaction is
left to the operator (`relay compact`, or the operations notebook) unless `compact=True`.

`live_traffic` lands pushes in real time (for the operations notebook's running stream).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from delta_tables import query
from delta_tables.group_commit import DeltaAppendTarget, LandingTarget
from delta_tables.layout import Layout
from delta_tables.schema import ACKS, C, LANDING, LANDING_SOURCE
from delta_tables.storage import RATIO_BOUND, Storage
from engine.heya.ids import event_id as heya_event_id
from engine.ppp.rooms import ROOM_PROTOCOL
from engine.trueseal.ids import event_id as trueseal_event_id
from runtime.config import Settings

from .inbox_stream import BATCH_TS, InboxSink
from .inbox_transform import StreamRules

Progress = Callable[[str], None]

ENVELOPES_PER_DAY = 20_000
BURSTS_PER_DAY = 480
MAILBOXES = 2_000
PROTOCOL_SHARE = {"trueseal": 0.6, "heya": 0.3, "ppp": 0.1}
MAILBOX_KEY_BYTES = 32        # trueseal device static key, Heya send token, PPP recipient key
ZIPF_S = 1.1
BUCKETS = (256, 1024, 4096, 16384)
BUCKET_SHARE = (0.55, 0.28, 0.10, 0.04)            # the remaining 3 % is unpadded
PPP_TTLS_H = (1, 6, 24, 168)            # sender-chosen expiry
PPP_TTL_SHARE = (0.25, 0.25, 0.30, 0.20)
PPP_EXPIRED_ON_ARRIVAL = 0.01
RETRY_SHARE = 0.03
DORMANT_SHARE = 0.05
BURST_SPREAD_S = 0.8          # receipts of one burst, then its group commit
ROOMS_PER_DAY = 40
ROOM_MESSAGES_PER_DAY = 1500
ROOM_CITIES = ((52.5219, 13.4132), (48.8566, 2.3522), (51.5072, -0.1276),
               (40.4168, -3.7038), (41.9028, 12.4964), (59.3293, 18.0686))
ROOM_LIFE_H = (2, 6, 24, 72)


def diurnal(hour: np.ndarray) -> np.ndarray:
    """Relative load by UTC hour of day: a night floor, a mid-day and an evening peak."""
    def bump(centre, width):
        d = np.minimum(np.abs(hour - centre), 24 - np.abs(hour - centre))
        return np.exp(-(d / width) ** 2)
    return 0.12 + 0.55 * bump(13.0, 3.5) + 0.45 * bump(20.5, 2.0)


def mailbox_counts(scale: float) -> dict[str, int]:
    total = max(20, int(MAILBOXES * max(scale, 0.01) ** 0.5))
    return {p: max(5, int(total * share)) for p, share in PROTOCOL_SHARE.items()}


class Population:
    """Mailboxes, their skew and their devices' habits, and envelope sizes: deterministic
    from the seed (Heya send tokens, minted by the control plane, are passed in, in the order
    they were minted), so a live run after `generate_day` writes to the same mailboxes."""

    def __init__(self, scale: float = 1.0, seed: int = 7,
                 heya_tokens: list[bytes] | None = None):
        rng = np.random.default_rng(seed)
        counts = mailbox_counts(scale)
        self.protocols = list(PROTOCOL_SHARE)
        if not heya_tokens:
            self.protocols.remove("heya")
        self.share = np.array([PROTOCOL_SHARE[p] for p in self.protocols])
        self.share = self.share / self.share.sum()
        self.keys: dict[str, list[bytes]] = {}
        self.weights: dict[str, np.ndarray] = {}
        for p in self.protocols:
            n = counts[p]
            self.keys[p] = [rng.bytes(MAILBOX_KEY_BYTES) for _ in range(n)] if p != "heya" \
                else list(heya_tokens)
            n = len(self.keys[p])
            w = 1.0 / np.arange(1, n + 1) ** ZIPF_S
            self.weights[p] = w / w.sum()
        # Per mailbox: probability its device is online when an envelope arrives, how long it
        # stays away otherwise (seconds), and whether it stays away all day.
        self.online: dict[tuple[str, bytes], float] = {}
        self.away_s: dict[tuple[str, bytes], float] = {}
        self.dormant: set[tuple[str, bytes]] = set()
        for p in self.protocols:
            for k in self.keys[p]:
                self.online[(p, k)] = float(rng.beta(5, 2))
                self.away_s[(p, k)] = float(rng.lognormal(np.log(2700), 1.0))
                if rng.random() < DORMANT_SHARE:
                    self.dormant.add((p, k))

    def draw(self, rng: np.random.Generator, n: int) -> tuple[list[str], list[bytes], np.ndarray]:
        """n (protocol, mailbox, size) triples."""
        pidx = rng.choice(len(self.protocols), size=n, p=self.share)
        protocols = [self.protocols[i] for i in pidx]
        mailboxes = []
        for p in protocols:
            keys = self.keys[p]
            mailboxes.append(keys[rng.choice(len(keys), p=self.weights[p])])
        kind = rng.choice(len(BUCKETS) + 1, size=n, p=list(BUCKET_SHARE) + [1 - sum(BUCKET_SHARE)])
        sizes = np.where(kind < len(BUCKETS), np.array(BUCKETS + (0,))[kind], 0)
        loose = kind == len(BUCKETS)
        # unpadded payloads (old clients, attachments sent raw): mostly small, a long tail
        odd = np.clip(rng.lognormal(np.log(700), 1.0, size=int(loose.sum())), 40, 60000)
        odd = odd.astype(np.int64)
        odd[np.isin(odd, BUCKETS)] += 1
        sizes[loose] = odd
        return protocols, mailboxes, sizes.astype(np.int64)


def mint_heya_tokens(layout: Layout, count: int, rng: np.random.Generator,
                     valid_from: datetime, valid_to: datetime) -> list[bytes]:
    """Register Heya mailboxes and mint `count` send tokens for them through the Heya
    control plane, as `relay heya inbox-token` + INCO + AUTH would; returns the tokens."""
    import asyncio
    from delta_tables.heya_control import HeyaControl, mint_inbox_tokens

    owners = [rng.bytes(32) for _ in range(max(1, count // 2))]  # SHA-256 of a client cert
    inbox_tokens = mint_inbox_tokens(layout, len(owners), fsync=False)
    clock = int((valid_from.timestamp()) * 1_000_000)

    async def register() -> list[bytes]:
        control = HeyaControl(layout, fsync=False, clock=lambda: clock)
        await control.load()
        for owner, inbox_token in zip(owners, inbox_tokens):
            if not await control.inco(owner, inbox_token):
                raise RuntimeError("heya INCO refused a freshly minted inbox token")
        tokens = []
        for i in range(count):
            tok = await control.auth(owners[i % len(owners)], int(valid_from.timestamp()),
                                     int(valid_to.timestamp()))
            tokens.append(tok.token)
        return tokens

    return asyncio.run(register())


def heya_tokens(layout: Layout) -> list[bytes]:
    """Live send tokens in the order they were minted (empty without Heya tables)."""
    from delta_tables.heya_state import load_state, table_paths
    paths = table_paths(layout)
    if not all((p / "_delta_log").exists() for p in paths.values()):
        return []
    state = load_state(paths)
    return [t.token for t in sorted(state.tokens.values(), key=lambda t: t.auth_at)]


def event_id(rng: np.random.Generator, protocol: str, mailbox: bytes, envelope: bytes) -> bytes:
    """As each protocol derives it (see the module docstring)."""
    if protocol == "trueseal":
        return trueseal_event_id(mailbox, envelope)
    if protocol == "heya":
        return heya_event_id(mailbox, hashlib.sha256(envelope).digest(), rng.bytes(16))
    return hashlib.blake2b(mailbox + envelope, digest_size=32, person=b"ppp.loadgen").digest()


def new_event_id_on_retry(protocol: str) -> bool:
    return protocol == "heya"


def ttls(settings: Settings) -> dict[str, timedelta]:
    """TTLs the relay sets at receipt (protocols whose sender sets none)."""
    return {"trueseal": timedelta(seconds=settings.trueseal.ttl_seconds),
            "heya": timedelta(seconds=getattr(getattr(settings, "heya", None), "ttl_seconds",
                                              settings.trueseal.ttl_seconds))}


def expiry(rng: np.random.Generator, relay_ttl: dict[str, timedelta], protocol: str,
           received: datetime) -> datetime:
    if protocol in relay_ttl:
        return received + relay_ttl[protocol]
    if rng.random() < PPP_EXPIRED_ON_ARRIVAL:   # the sender's clock or outbox was stale
        return received - timedelta(seconds=float(rng.uniform(60, 7200)))
    return received + timedelta(hours=float(rng.choice(PPP_TTLS_H, p=PPP_TTL_SHARE)))


@dataclass
class DayReport:
    start: datetime
    end: datetime
    envelopes: int = 0            # distinct pushes
    retries: int = 0              # extra landings of an envelope that already landed
    rooms: int = 0
    room_messages: int = 0
    landing_commits: int = 0
    batches: int = 0
    inbox_rows: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    acks: int = 0
    wakeups: int = 0
    landing_dropped: int = 0
    seconds: float = 0.0
    # `retain`: the tables once compaction's retention passed (docs/operating/retention.md)
    tables_bytes_before: int | None = None  # all tables before compaction
    tables_bytes_after: int | None = None   # all tables after two runs, retention between
    storage_before: Storage | None = None   # the day as written, before compaction
    storage_after: Storage | None = None    # after the second run

    @property
    def live_bytes(self) -> int | None:     # pending ciphertext
        return None if self.storage_after is None else self.storage_after.live_bytes

    @property
    def table_bytes(self) -> dict[str, int]:
        return {} if self.storage_after is None else self.storage_after.table_bytes

    @property
    def storage_ratio(self) -> float | None:
        return None if self.storage_after is None else self.storage_after.ratio

    def storage_results(self) -> dict:
        """The storage figures before and after, as `--results` writes them (JSON)."""
        def one(st: Storage) -> dict:
            return {"live_bytes": st.live_bytes, "row_metadata_bytes": st.row_metadata_bytes,
                    "on_disk": st.on_disk, "ratio": st.ratio, "table_bytes": st.table_bytes}
        return {"day": f"{self.start:%Y-%m-%d %H:%M} -> {self.end:%Y-%m-%d %H:%M} UTC",
                "pushes": self.envelopes, "inbox_rows": self.inbox_rows,
                "ratio_bound": RATIO_BOUND,
                "before": one(self.storage_before) if self.storage_before else None,
                "after": one(self.storage_after) if self.storage_after else None}

    def format(self) -> str:
        rej = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())) or "none"
        retained = [] if self.storage_after is None else [
            f"after retention      tables {self.tables_bytes_before} -> "
            f"{self.tables_bytes_after} bytes, live ciphertext {self.live_bytes} + row "
            f"metadata {self.storage_after.row_metadata_bytes} bytes, storage ratio "
            f"{self.storage_before.ratio or 0:.2f}x -> {self.storage_ratio or 0:.2f}x "
            f"(bound {RATIO_BOUND:.0f}x)",
            "  per table          " + ", ".join(f"{k} {v}" for k, v in self.table_bytes.items())]
        return "\n".join(retained + [
            f"day                  {self.start:%Y-%m-%d %H:%M} -> {self.end:%Y-%m-%d %H:%M} UTC",
            f"pushes               {self.envelopes} (+{self.retries} client retries)",
            f"rooms                {self.rooms}, {self.room_messages} room messages",
            f"landing commits      {self.landing_commits}",
            f"stream micro-batches {self.batches}",
            f"inbox rows           {self.inbox_rows}",
            f"rejected             {rej}",
            f"acks                 {self.acks}",
            f"push wake-ups        {self.wakeups}",
            f"landing dropped      {self.landing_dropped} generation(s), sealed and consumed",
            f"took                 {self.seconds:.1f} s",
        ])


class _ArrowBatch:
    """What InboxSink needs of a Spark micro-batch DataFrame: `toArrow()`."""

    def __init__(self, table: pa.Table):
        self._table = table

    def toArrow(self) -> pa.Table:
        return self._table


def _day_window(day: str | None, hours: float) -> tuple[datetime, datetime]:
    if day:
        start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=timezone.utc)
        return start, start + timedelta(hours=hours)
    # the `hours` up to the start of the current hour: the day just gone
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    return end - timedelta(hours=hours), end


def _burst_times(rng: np.random.Generator, start: datetime, hours: float,
                 n: int) -> list[datetime]:
    minutes = int(hours * 60)
    grid = start + np.arange(minutes) * timedelta(minutes=1)
    hour_of_day = np.array([t.hour + t.minute / 60 for t in grid])
    w = diurnal(hour_of_day)
    picks = np.sort(rng.choice(minutes, size=n, p=w / w.sum()))
    offsets = rng.uniform(0, 60 - 2 * BURST_SPREAD_S, size=n)
    times = sorted(start + timedelta(minutes=int(m), seconds=float(o))
                   for m, o in zip(picks, offsets))
    # two bursts in one second would be one group commit: keep them apart
    for i in range(1, len(times)):
        if times[i] < times[i - 1] + timedelta(seconds=2):
            times[i] = times[i - 1] + timedelta(seconds=2)
    return [t for t in times if t < start + timedelta(hours=hours) - timedelta(seconds=5)]


def generate_day(settings: Settings, *, day: str | None = None, hours: float = 24.0,
                 scale: float = 1.0, seed: int = 7, compact: bool = False,
                 retain: bool = False, progress: Progress | None = None) -> DayReport:
    """Fill `settings.data_dir` with one synthetic day (see the module docstring). The data
    directory must not hold an inbox yet, and no relay process may be running on it.
    `retain`: compact, wait `compaction.vacuum_retention_seconds`, compact again, and report
    the tables' bytes against the live ciphertext (the storage ratio)."""
    say = progress or (lambda _msg: None)
    t_start = time.monotonic()
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    if query.read(DeltaTable(str(layout.inbox)), [C.SEQ]).num_rows:
        raise RuntimeError(f"{layout.root} already has an inbox: generate into a fresh directory")
    start, end = _day_window(day, hours)
    rng = np.random.default_rng(seed)
    relay_ttl = ttls(settings)
    tokens = mint_heya_tokens(layout, mailbox_counts(scale)["heya"], rng,
                              start - timedelta(days=1), end + relay_ttl["heya"])
    pop = Population(scale, seed, tokens)
    report = DayReport(start, end)

    # -- what arrives when ---------------------------------------------------------------
    n = max(10, int(ENVELOPES_PER_DAY * scale * hours / 24))
    bursts = _burst_times(rng, start, hours,
                          max(12, int(BURSTS_PER_DAY * max(scale, 0.01) ** 0.5 * hours / 24)))
    burst_of = np.sort(rng.integers(0, len(bursts), size=n))
    protocols, mailboxes, sizes = pop.draw(rng, n)
    rows_by_burst: list[list[dict]] = [[] for _ in bursts]
    landed: list[dict] = []
    for i in range(n):
        b = int(burst_of[i])
        recv = bursts[b] + timedelta(seconds=float(rng.uniform(0, BURST_SPREAD_S)))
        env = rng.bytes(int(sizes[i]))
        row = {C.EVENT_ID: event_id(rng, protocols[i], mailboxes[i], env),
               C.PROTOCOL: protocols[i], C.MAILBOX: mailboxes[i], C.ENVELOPE: env, C.META: None,
               C.RECEIVED_AT: recv, C.EXPIRES_AT: expiry(rng, relay_ttl, protocols[i], recv)}
        rows_by_burst[b].append(row)
        landed.append((b, row))
    burst_epoch = np.array([t.timestamp() for t in bursts])
    for b, row in [landed[i] for i in rng.choice(n, size=int(n * RETRY_SHARE), replace=False)]:
        # a client that did not hear the Ack retries: soon (reconnect) or much later
        delay = rng.lognormal(np.log(5), 1.0) if rng.random() < 0.6 else \
            rng.lognormal(np.log(600), 1.0)
        later = int(np.searchsorted(burst_epoch, bursts[b].timestamp() + delay))
        if later >= len(bursts):
            continue
        recv = bursts[later] + timedelta(seconds=float(rng.uniform(0, BURST_SPREAD_S)))
        p = row[C.PROTOCOL]
        retry = dict(row, **{C.RECEIVED_AT: recv})
        if p in relay_ttl:
            retry[C.EXPIRES_AT] = recv + relay_ttl[p]
        if new_event_id_on_retry(p):
            retry[C.EVENT_ID] = event_id(rng, p, row[C.MAILBOX], row[C.ENVELOPE])
        rows_by_burst[later].append(retry)
        report.retries += 1
    report.rooms, room_rows = _room_traffic(layout, rng, start, end, scale)
    for t, row in room_rows:
        b = int(np.searchsorted(burst_epoch, t.timestamp()))
        if b < len(bursts):
            rows_by_burst[b].append(dict(row, **{C.RECEIVED_AT: bursts[b] + timedelta(
                seconds=float(rng.uniform(0, BURST_SPREAD_S)))}))
            report.room_messages += 1
    report.envelopes = n
    say(f"loadgen: {n} pushes (+{report.retries} retries) in {len(bursts)} bursts, "
        f"{start:%Y-%m-%d %H:%M} -> {end:%Y-%m-%d %H:%M} UTC")

    # -- ingress and the stream, burst by burst, on the simulated clock -----------------------
    conf = settings.ingress
    target = LandingTarget(layout, conf.node_id,
                           commits_per_generation=conf.commits_per_generation, fsync=False)
    checkpoint = layout.root / "checkpoints" / "loadgen"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "metadata").write_text(json.dumps(
        {"id": f"loadgen-{seed}-{start:%Y%m%dT%H%M}"}))
    rules = StreamRules.from_conf(settings.stream,
                                  max_envelope={"trueseal": settings.trueseal.max_envelope})
    sink = InboxSink(layout, rules, checkpoint, settings.stream.app_id, fsync=False)
    schema, source_schema = LANDING.arrow_schema(), LANDING_SOURCE.arrow_schema()
    day_tables: dict[str, int] = {}
    for b, rows in enumerate(rows_by_burst):
        if not rows:
            continue
        rows.sort(key=lambda r: r[C.RECEIVED_AT])
        table = pa.Table.from_pylist(rows, schema=schema)
        result = target.commit(table)
        day_tables[result.table] = result.version
        # the micro-batch that picks the commit up: next trigger, then ~150 ms of work
        batch_ts = rows[-1][C.RECEIVED_AT] + timedelta(
            seconds=0.01 + float(rng.uniform(0, settings.stream.trigger_interval_ms / 1000))
            + float(rng.lognormal(np.log(0.15), 0.4)))
        k = table.num_rows
        batch = table.append_column(source_schema.field(C.LANDING_TABLE),
                                    pa.array([result.table] * k, pa.string())) \
            .append_column(source_schema.field(C.LANDING_VERSION),
                           pa.array([result.version] * k, pa.int64())) \
            .append_column(BATCH_TS, pa.array([batch_ts] * k, pa.timestamp("us", tz="UTC")))
        sink(_ArrowBatch(batch), report.batches)
        report.batches += 1
        report.landing_commits += 1
        if report.batches % 100 == 0:
            say(f"loadgen: {report.batches} micro-batches, simulated clock {batch_ts:%H:%M}")
    inbox = query.read(DeltaTable(str(layout.inbox)), [
        C.PROTOCOL, C.MAILBOX, C.EVENT_ID, C.SEQ, C.CURSOR, C.COMMITTED_AT, C.EXPIRES_AT])
    report.inbox_rows = inbox.num_rows
    rejects = query.read(DeltaTable(str(layout.rejects)), [C.REASON])
    for reason in rejects.column(C.REASON).to_pylist():
        report.rejected[reason] = report.rejected.get(reason, 0) + 1

    # -- devices come and go: acks ------------------------------------------------------------
    report.acks = _write_acks(layout, inbox, pop, rng, end)
    report.wakeups = _write_push_log(layout, inbox, pop, rng, settings.push.window_seconds)

    # -- seal the day's landing, as the stream and compaction would ---------------------------
    layout.ensure_landing(conf.node_id, target.generation + 1)
    consumed = layout.read_landing_consumed()
    consumed.update(day_tables)
    layout.write_landing_consumed(consumed)
    from .compact import drop_consumed_landing, run_compaction
    report.landing_dropped = drop_consumed_landing(layout)
    # one moment for every run and measure: the second run then finds nothing new to purge
    # or expire, and only lets the first's retention pass (VACUUM and the log cleanup go by
    # the real clock)
    now = datetime.now(timezone.utc)
    if retain:
        from delta_tables import storage
        report.storage_before = storage.measure(layout, now)
    if compact or retain:
        first = run_compaction(settings, now=now, progress=say)
        say(first.format())
        if retain:
            _let_retention_pass(settings, layout, first, now, report, say)
    report.seconds = time.monotonic() - t_start
    return report


def _let_retention_pass(settings: Settings, layout: Layout, first, now: datetime,
                        report: DayReport, say: Progress) -> None:
    from delta_tables import storage

    from .compact import run_compaction
    wait = settings.compaction.vacuum_retention_seconds + 1
    say(f"waiting {wait} s for compaction's retention, then compacting again")
    time.sleep(wait)
    second = run_compaction(settings, now=now, progress=say)
    report.tables_bytes_before = first.bytes_before
    report.tables_bytes_after = second.bytes_after
    report.storage_after = storage.measure(layout, now)


def _room_traffic(layout: Layout, rng: np.random.Generator, start: datetime, end: datetime,
                  scale: float) -> tuple[int, list[tuple[datetime, dict]]]:
    """Rooms created through the PPP control plane at their simulated times; returns how
    many, and landing rows of their messages (time, row), within each room's life and the
    day."""
    import asyncio

    import msgpack

    from delta_tables.ppp_control import PppControl
    from engine.ppp.rooms import (TYPE_ROOM, Room, cell_token, room_envelope,
                                  room_event_id)
    k = max(8, int(ROOMS_PER_DAY * max(scale, 0.01) ** 0.5))
    span = (end - start).total_seconds()
    city_w = 1.0 / np.arange(1, len(ROOM_CITIES) + 1) ** ZIPF_S
    rooms = []
    for _ in range(k):
        lat, lon = ROOM_CITIES[int(rng.choice(len(ROOM_CITIES), p=city_w / city_w.sum()))]
        lat, lon = lat + float(rng.normal(0, 0.04)), lon + float(rng.normal(0, 0.06))
        created = start.timestamp() + float(rng.uniform(0, 0.8 * span))
        life = 3600 * float(rng.choice(ROOM_LIFE_H))
        rooms.append(Room(rng.bytes(16), rng.bytes(32), TYPE_ROOM, cell_token(lat, lon, 16),
                          cell_token(lat, lon, 10), bool(rng.random() < 0.7), False,
                          bool(rng.random() < 0.5), 50, int(created), int(created + life)))
    rooms.sort(key=lambda r: r.created_at)
    clock = {"now": 0}

    async def create() -> None:
        control = PppControl(layout, fsync=False, clock=lambda: clock["now"])
        await control.load()
        for room in rooms:
            clock["now"] = room.created_at * 1_000_000
            await control.create_room(room, room.created_at)
    asyncio.run(create())
    m = max(40, int(ROOM_MESSAGES_PER_DAY * scale))
    w = 1.0 / np.arange(1, k + 1) ** ZIPF_S
    out = []
    for i in rng.choice(k, size=m, p=w / w.sum()):
        room = rooms[int(i)]
        hi = min(room.expires_at, end.timestamp())
        t = float(rng.uniform(room.created_at, hi)) if hi > room.created_at else hi
        nonce = rng.bytes(24)
        ct = rng.bytes(int(rng.choice(BUCKETS[:2], p=(0.8, 0.2))) + 16)
        when = datetime.fromtimestamp(t, timezone.utc)
        out.append((when, {
            C.EVENT_ID: room_event_id(room.room_id, nonce, ct), C.PROTOCOL: ROOM_PROTOCOL,
            C.MAILBOX: room.room_id, C.ENVELOPE: room_envelope(nonce, ct),
            C.META: msgpack.packb(int(t)), C.RECEIVED_AT: when,
            C.EXPIRES_AT: datetime.fromtimestamp(room.expires_at, timezone.utc)}))
    out.sort(key=lambda x: x[0])
    return k, out


def _write_acks(layout: Layout, inbox: pa.Table, pop: Population, rng: np.random.Generator,
                end: datetime) -> int:
    """One ack per envelope whose device got it before `end` and before it expired."""
    cols = {c: inbox.column(c).to_pylist() for c in (C.PROTOCOL, C.MAILBOX, C.EVENT_ID, C.SEQ,
                                                     C.CURSOR, C.COMMITTED_AT, C.EXPIRES_AT)}
    rows = []
    for i in range(inbox.num_rows):
        key = (cols[C.PROTOCOL][i], cols[C.MAILBOX][i])
        if key in pop.dormant or key[0] == ROOM_PROTOCOL:   # room messages are never acked
            continue
        if rng.random() < pop.online.get(key, 0.5):
            delay = rng.lognormal(np.log(0.4), 0.7)           # delivered at once, acked
        else:                                                 # waits for the device
            delay = rng.exponential(pop.away_s.get(key, 2700)) + rng.lognormal(np.log(1.0), 0.5)
        acked = cols[C.COMMITTED_AT][i] + timedelta(seconds=float(delay))
        if acked > end or acked >= cols[C.EXPIRES_AT][i]:
            continue   # still pending at the end of the day, or expired undelivered
        rows.append({C.PROTOCOL: key[0], C.MAILBOX: key[1], C.EVENT_ID: cols[C.EVENT_ID][i],
                     C.SEQ: cols[C.SEQ][i], C.CURSOR: cols[C.CURSOR][i], C.DEVICE: None,
                     C.ACKED_AT: acked})
    if not rows:
        return 0
    rows.sort(key=lambda r: r[C.ACKED_AT])
    table = pa.Table.from_pylist(rows, schema=ACKS.arrow_schema())
    # one commit per hour of acks, as egress's group commits would land over a day
    hours = pc.cast(table.column(C.ACKED_AT), pa.int64()).to_numpy() // 3_600_000_000
    target = DeltaAppendTarget(layout.acks, ACKS, fsync=False)
    cuts = np.nonzero(np.diff(hours))[0] + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(rows)]):
        target.commit(table.slice(int(lo), int(hi - lo)))
    return len(rows)


PUSH_PLATFORMS = (("apns", 0.55), ("fcm", 0.40), ("webpush", 0.05))
PUSH_OUTCOMES = (("sent", 0.965), ("unregistered", 0.02), ("retry_exhausted", 0.005),
                 ("failed", 0.01))
PUSH_REGISTERED = 0.8     # share of mailboxes with a push token (trueseal has none: spec 000)


def _write_push_log(layout: Layout, inbox: pa.Table, pop: Population, rng: np.random.Generator,
                    window: float) -> int:
    """What `relay push` would have recorded: a wake-up per offline device per window, for
    the PPP, Heya and cursor-sync rows of the day (push_log's schema, delta_tables/schema_push.py)."""
    from delta_tables.schema_push import INTENT, PL, PUSH_LOG
    cols = {c: inbox.column(c).to_pylist() for c in (C.PROTOCOL, C.MAILBOX, C.COMMITTED_AT)}
    platforms, p_w = zip(*PUSH_PLATFORMS)
    outcomes, o_w = zip(*PUSH_OUTCOMES)
    last: dict[tuple[str, bytes], datetime] = {}
    rows = []
    for i in np.argsort(np.array([t.timestamp() for t in cols[C.COMMITTED_AT]]), kind="stable"):
        key = (cols[C.PROTOCOL][i], cols[C.MAILBOX][i])
        if key[0] not in ("ppp", "heya", "sync") or rng.random() < pop.online.get(key, 0.5):
            continue
        if int.from_bytes(hashlib.blake2b(key[1], digest_size=2).digest(), "big") \
                >= PUSH_REGISTERED * 65536:
            continue
        at = cols[C.COMMITTED_AT][i]
        if key in last and (at - last[key]).total_seconds() < window:
            continue
        last[key] = at
        # a mailbox's device keeps its platform all day
        u = int.from_bytes(hashlib.blake2b(key[1], digest_size=4, person=b"platform")
                           .digest(), "big") / 2 ** 32
        platform = platforms[int(np.searchsorted(np.cumsum(p_w), u, side="right"))]
        took = float(rng.lognormal(np.log(60 if platform == "apns" else 90), 0.5))
        to_push = float(rng.lognormal(np.log(150), 0.4)) + took
        outcome = outcomes[int(rng.choice(len(outcomes), p=o_w))]
        answered = at + timedelta(milliseconds=to_push)
        base = {PL.PROTOCOL: key[0], PL.PLATFORM: platform,
                PL.DEVICE: hashlib.blake2b(key[1], digest_size=16, key=b"loadgen").digest(),
                PL.TRIGGER: "message", PL.WAKE_AT: at + timedelta(milliseconds=to_push - took)}
        rows.append({**base, PL.AT: base[PL.WAKE_AT], PL.OUTCOME: INTENT, PL.REASON: None,
                     PL.ATTEMPTS: 0, PL.LATENCY_MS: None, PL.INBOX_TO_PUSH_MS: None})
        rows.append({**base, PL.AT: answered, PL.OUTCOME: outcome, PL.REASON: None,
                     PL.ATTEMPTS: 1 if outcome != "retry_exhausted" else 5,
                     PL.LATENCY_MS: int(took), PL.INBOX_TO_PUSH_MS: int(to_push)})
    if rows:
        path = layout.ensure_tables({PUSH_LOG.name: PUSH_LOG})[PUSH_LOG.name]
        DeltaAppendTarget(path, PUSH_LOG, fsync=False).commit(
            pa.Table.from_pylist(rows, schema=PUSH_LOG.arrow_schema()))
    return len(rows) // 2


@dataclass
class LiveReport:
    pushes: int = 0
    retries: int = 0
    expired: int = 0
    commits: int = 0
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (first, last)


def live_traffic(settings: Settings, *, seconds: float = 20.0, per_second: float = 80.0,
                 scale: float = 1.0, seed: int = 7, stop: threading.Event | None = None,
                 commit_every: float = 0.25) -> LiveReport:
    """Land pushes now, in real time, as ingress would (group commits every `commit_every`
    seconds), to the same mailboxes as the synthetic day; with client retries and a few
    already-expired ppp envelopes, so the stream has duplicates and expiries to reject."""
    stop = stop or threading.Event()
    rng = np.random.default_rng(seed + int(time.time()))
    relay_ttl = ttls(settings)
    layout = Layout.of(settings)
    pop = Population(scale, seed, heya_tokens(layout))
    target = LandingTarget(layout, settings.ingress.node_id,
                           commits_per_generation=settings.ingress.commits_per_generation,
                           fsync=False)
    schema = LANDING.arrow_schema()
    report = LiveReport()
    recent: list[dict] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        k = int(rng.poisson(per_second * commit_every))
        now = datetime.now(timezone.utc)
        protocols, mailboxes, sizes = pop.draw(rng, k)
        rows = []
        for p, m, s in zip(protocols, mailboxes, sizes):
            env = rng.bytes(int(s))
            exp = expiry(rng, relay_ttl, p, now)
            if p not in relay_ttl and rng.random() < 0.2:
                exp = now - timedelta(minutes=5)
            report.expired += exp <= now
            rows.append({C.EVENT_ID: event_id(rng, p, m, env), C.PROTOCOL: p, C.MAILBOX: m,
                         C.ENVELOPE: env, C.META: None, C.RECEIVED_AT: now, C.EXPIRES_AT: exp})
        retried = [recent[int(i)] for i in rng.choice(
            len(recent), size=min(len(recent), int(rng.poisson(k * 0.05))), replace=False)] \
            if recent else []
        for old in retried:
            retry = dict(old, **{C.RECEIVED_AT: now})
            if new_event_id_on_retry(old[C.PROTOCOL]):
                retry[C.EVENT_ID] = event_id(rng, old[C.PROTOCOL], old[C.MAILBOX],
                                             old[C.ENVELOPE])
            rows.append(retry)
            report.retries += 1
        if rows:
            result = target.commit(pa.Table.from_pylist(rows, schema=schema))
            first, _ = report.tables.get(result.table, (result.version, result.version))
            report.tables[result.table] = (first, result.version)
            report.commits += 1
            report.pushes += k
            recent = (recent + rows[:k])[-500:]
        stop.wait(commit_every)
    return report
