"""`relay push`: follow the inbox and wake offline devices, at most once per window each.

Each step:
1. read the inbox commits since the last step (the stream's appends, `read_appends`), the
   rows of the protocols with push registrations (PPP, Heya, cursor-sync);
2. ask each protocol's listener (its push desk, runtime/push_desk.py) which registered
   devices of each row's mailbox are offline and still owed the row; a desk that does not
   answer keeps its rows for the next step (*held*);
3. decide per device (engine/push/coalesce.py): send now, covered by a recent wake-up, or
   deferred to the end of the window; plus the desks' own requests (a PPP knock) and the
   deferred wake-ups now due (re-checked: an owner online by then is not woken);
4. record an `intent` row per wake-up in `push_log` (one commit), then send them, each with
   its retries, concurrently (at most `push.max_in_flight` provider requests);
5. commit the finished outcomes with the Delta app-transaction marker (`relay-push`, V):
   every inbox row at or below version V has had its wake-ups decided and, if sent,
   answered. V stays below any row still held, deferred or in flight.

Restart: the marker says where to read on from; the planner is rebuilt from the log's last
window, so a window already woken is not woken again; an intent with no outcome (killed
mid-request) is sent again under the same collapse id, so the wake-up is never lost and a
device that got both shows one. A permanent failure deletes the token through its owner's
desk (durably, in the protocol's control table), retried until the desk answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from delta_tables.group_commit import DeltaAppendTarget, DirectAppendTarget, fsync_version
from delta_tables.landing_lag import LogFollower
from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX
from delta_tables.schema_push import INTENT, PL, PUSH_LOG
from engine.push import requests as R
from engine.push.coalesce import Decision, WakePlanner
from engine.push.outcomes import Answer, Outcome, backoff
from runtime.inbox_signal import InboxSignal, signal_dir
from runtime.keys import load_or_create
from runtime.push_desk import DeskClient, DeskUnavailable, Device, desk_dir

from ..inbox_tail import read_appends
from .providers import Provider

log = logging.getLogger("relay.push")
APP_ID = "relay-push"
PROTOCOLS = ("ppp", "heya", "sync")
DEVICE_KEY_FILE = "push_device.key"
MARKER_EVERY_SECONDS = 5.0       # an advanced marker with no outcome rows is committed this often
DRAIN_SECONDS = 5.0              # on stop, in-flight requests get this long to finish
DESK_BATCH = 2000                # rows per desk request (a first start's backlog can be large)
_COLS = [C.PROTOCOL, C.MAILBOX, C.CURSOR, C.META, C.COMMITTED_AT, C.ENVELOPE]
_SCHEMA = pa.schema([INBOX.arrow_schema().field(c) for c in _COLS])


def _us(t: float) -> int:
    return int(t * 1_000_000)


def _ts(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1_000_000, timezone.utc)


@dataclass(frozen=True)
class Row:
    protocol: str
    mailbox: bytes
    cursor: int
    meta: bytes | None
    version: int
    committed_at: float        # unix s: the inbox commit (commitInfo.timestamp)

    def __repr__(self) -> str:
        return f"Row({self.protocol}, v{self.version})"


@dataclass
class Wake:
    key: bytes
    protocol: str
    device: Device
    trigger: str                  # message | deferred | knock
    version: int | None           # the inbox version that caused it (None: knock, deferred)
    caused_at: float | None       # its inbox commit (unix s)
    wake_at_us: int = 0


@dataclass
class Stats:
    rows: int = 0
    decided: Counter = field(default_factory=Counter)     # send / covered / defer
    outcomes: Counter = field(default_factory=Counter)    # (platform, outcome)
    held: int = 0
    drops: int = 0


class PushJob:
    def __init__(self, settings, providers: dict[str, Provider], *, metrics=None,
                 clock=time.time):
        self.settings = settings
        self.conf = settings.push
        layout = Layout.of(settings)
        self.layout = layout
        self.inbox_path = layout.inbox
        self._log = LogFollower(self.inbox_path)
        self.log_path = layout.table(PUSH_LOG)
        self.providers = providers
        self.metrics = metrics
        self.clock = clock
        self.planner = WakePlanner(self.conf.window_seconds)
        self.desks = DeskClient(desk_dir(settings.data_dir))
        self._secret = load_or_create(settings.data_dir, DEVICE_KEY_FILE).private_bytes
        self.version = -1                 # inbox read up to here
        self.held: list[Row] = []         # rows whose desk did not answer
        self.deferred: dict[bytes, tuple[str, bytes, int | None]] = {}  # key -> (p, owner, v)
        self.inflight: Counter = Counter()   # inbox version -> wake-ups being sent
        self.unsure: dict[bytes, int] = {}   # key -> wake_at µs of an intent with no outcome
        self.done_rows: list[dict] = []      # outcome rows not committed yet
        self.drops: list[tuple[str, Device]] = []
        self.marker = -1                      # committed
        self._marker_at = 0.0
        self._sem = asyncio.Semaphore(max(1, self.conf.max_in_flight))
        self._tasks: set[asyncio.Task] = set()
        self._intents: DirectAppendTarget | None = None
        self.stats = Stats()

    def __repr__(self) -> str:
        return f"PushJob(version={self.version}, planner={len(self.planner)})"

    # --- identity ---------------------------------------------------------------------------
    def device_key(self, protocol: str, d: Device) -> bytes:
        h = hashlib.blake2b(key=self._secret, digest_size=16, person=b"relay-push-dev")
        for part in (protocol.encode(), d.owner, d.platform.encode(), d.token):
            h.update(len(part).to_bytes(4, "big") + part)
        return h.digest()

    # --- start ------------------------------------------------------------------------------
    def _restore(self) -> None:
        """The marker, and the planner's view of the last window, from push_log."""
        dt = DeltaTable(str(self.log_path))
        v = dt.transaction_version(APP_ID)
        self.marker = -1 if v is None else v
        since = pa.scalar(datetime.fromtimestamp(self.clock() - self.planner.window - 60,
                                                 timezone.utc), pa.timestamp("us", tz="UTC"))
        t = dt.to_pyarrow_dataset().to_table(
            columns=[PL.DEVICE, PL.OUTCOME, PL.WAKE_AT],
            filter=pc.field(PL.WAKE_AT) > since)
        rows = sorted(zip(pc.cast(t.column(PL.WAKE_AT), pa.int64()).to_pylist(),
                          t.column(PL.DEVICE).to_pylist(), t.column(PL.OUTCOME).to_pylist()))
        finished = {(dev, at) for at, dev, outcome in rows if outcome != INTENT}
        for at, dev, outcome in rows:          # in time order, as the planner asks
            unsure = outcome == INTENT and (dev, at) not in finished
            self.planner.restore(dev, at / 1e6, unsure=unsure)
            if unsure:
                self.unsure[dev] = at
            else:                              # a later wake-up of the device settled it
                self.unsure.pop(dev, None)
        self.version = self.marker

    async def start(self) -> None:
        await asyncio.to_thread(self.layout.ensure_shared_tables)
        await asyncio.to_thread(self.layout.ensure_tables, {PUSH_LOG.name: PUSH_LOG})
        await asyncio.to_thread(self._restore)
        if self.marker < 0:
            # First start: wake for what is already waiting in the inbox, from its snapshot.
            self.version, rows = await asyncio.to_thread(self._snapshot_rows)
            self.held.extend(rows)
        dry = {p: getattr(prov, "why", "") for p, prov in self.providers.items()
               if not prov.configured}
        log.info("push job started", extra={
            "event": "push_started", "inbox_version": self.version, "marker": self.marker,
            "unsure": len(self.unsure), "window_seconds": self.planner.window,
            "dry_run": sorted(dry)})
        for platform, why in sorted(dry.items()):
            log.warning("push platform has no credentials: its wake-ups are recorded as "
                        "dry_run, not sent", extra={"event": "push_dry_run",
                                                    "platform": platform, "why": why})

    # --- reading the inbox ------------------------------------------------------------------
    @staticmethod
    def _rows(t: pa.Table, version: int, committed: float | None = None) -> list[Row]:
        """`committed`: the inbox commit's time; else the row's micro-batch time."""
        t = t.filter(pc.and_(pc.is_in(t.column(C.PROTOCOL), pa.array(PROTOCOLS)),
                             pc.is_valid(t.column(C.ENVELOPE))))
        batch = pc.cast(t.column(C.COMMITTED_AT), pa.int64()).to_pylist()
        return [Row(p, m, c, meta, version, committed or (at or 0) / 1e6)
                for p, m, c, meta, at in zip(
                    t.column(C.PROTOCOL).to_pylist(), t.column(C.MAILBOX).to_pylist(),
                    t.column(C.CURSOR).to_pylist(), t.column(C.META).to_pylist(), batch)]

    def _snapshot_rows(self) -> tuple[int, list[Row]]:
        dt = DeltaTable(str(self.inbox_path))
        version = dt.version()
        now = pa.scalar(datetime.fromtimestamp(self.clock(), timezone.utc),
                        pa.timestamp("us", tz="UTC"))
        t = dt.to_pyarrow_dataset().to_table(
            columns=_COLS, filter=pc.field(C.EXPIRES_AT) > now).cast(_SCHEMA)
        return version, self._rows(t, version)

    def _read_new(self) -> list[Row]:
        latest = self._log.latest(self.version)
        if self.metrics is not None:
            self.metrics.lag.set(max(0, latest - self.version))
        if latest <= self.version:
            return []
        try:
            parts = read_appends(self.inbox_path, self.version + 1, latest, _COLS, _SCHEMA)
        except LookupError:
            log.warning("push job lagged past the inbox log; reading its snapshot",
                        extra={"event": "push_rebuild"})
            self.version, rows = self._snapshot_rows()
            return rows
        self.version = latest
        return [r for a in parts for r in self._rows(a.rows, a.version, a.committed)]

    # --- one step ---------------------------------------------------------------------------
    async def step(self) -> int:
        """Read, decide, record intents, start the sends; commit finished outcomes. Returns
        how many wake-ups were started."""
        rows = self.held + await asyncio.to_thread(self._read_new)
        self.held = []
        try:
            started = await self._decide_and_send(rows)
        except BaseException:
            # Nothing was sent for these rows (sends start only after their intents are
            # durable, the last thing that can fail): keep them all for the next step.
            self.held = rows
            raise
        await self._drop_dead()
        await self._commit_outcomes()
        self.planner.prune(self.clock())
        self.unsure = {k: v for k, v in self.unsure.items() if k in self.planner}
        return started

    async def _decide_and_send(self, rows: list[Row]) -> int:
        self.stats.rows += len(rows)
        now = self.clock()
        wakes: dict[bytes, Wake] = {}
        held: list[Row] = []
        by_protocol: dict[str, list[Row]] = {}
        for r in rows:
            by_protocol.setdefault(r.protocol, []).append(r)
        batches = [(p, mine[i:i + DESK_BATCH]) for p, mine in by_protocol.items()
                   for i in range(0, len(mine), DESK_BATCH)]
        for protocol, mine in batches:
            try:
                answers = await self.desks.wake(
                    protocol, [(r.mailbox, r.cursor, r.meta) for r in mine])
            except DeskUnavailable:
                held.extend(mine)
                continue
            for r, devices in zip(mine, answers):
                for d in devices:
                    self._offer(wakes, Wake(self.device_key(protocol, d), protocol, d,
                                            "message", r.version, r.committed_at), now)
        await self._knocks(wakes, now)
        await self._due(wakes, now)
        started = await self._send_all(list(wakes.values()), now)
        self.held = held
        self.stats.held = len(held)
        return started

    def _offer(self, wakes: dict[bytes, Wake], w: Wake, now: float) -> None:
        if w.key in wakes:
            return
        decision = self.planner.offer(w.key, now, w.device.last_seen)
        self.stats.decided[decision.value] += 1
        if decision is Decision.SEND:
            wakes[w.key] = w
        elif decision is Decision.DEFER:
            old = self.deferred.get(w.key)
            versions = [v for v in (old[2] if old else None, w.version) if v is not None]
            self.deferred[w.key] = (w.protocol, w.device.owner,
                                    min(versions) if versions else None)

    async def _knocks(self, wakes: dict[bytes, Wake], now: float) -> None:
        try:
            devices = await self.desks.pending("ppp")
        except DeskUnavailable:
            return
        for d in devices:
            self._offer(wakes, Wake(self.device_key("ppp", d), "ppp", d, "knock", None, None),
                        now)

    async def _due(self, wakes: dict[bytes, Wake], now: float) -> None:
        for key in self.planner.take_due(now):
            protocol, owner, _ = self.deferred.get(key, (None, None, None))
            if protocol is None:
                self.planner.cancel(key)
                continue
            try:
                online, devices = await self.desks.owner(protocol, owner)
            except DeskUnavailable:
                continue                       # due stays; asked again next step
            self.planner.cancel(key)
            del self.deferred[key]
            if online:
                continue
            for d in devices:
                if self.device_key(protocol, d) == key and key not in wakes:
                    wakes[key] = Wake(key, protocol, d, "deferred", None, None)

    # --- sending ----------------------------------------------------------------------------
    def _log_row(self, w: Wake, outcome: str, *, reason: str | None = None, attempts: int = 0,
                 latency_ms: int | None = None, answered: float | None = None) -> dict:
        return {PL.AT: _ts(_us(self.clock())), PL.PROTOCOL: w.protocol,
                PL.PLATFORM: w.device.platform, PL.DEVICE: w.key, PL.TRIGGER: w.trigger,
                PL.OUTCOME: outcome, PL.REASON: reason, PL.ATTEMPTS: attempts,
                PL.WAKE_AT: _ts(w.wake_at_us), PL.LATENCY_MS: latency_ms,
                PL.INBOX_TO_PUSH_MS: (None if w.caused_at is None or answered is None
                                      else max(0, int((answered - w.caused_at) * 1000)))}

    def _record_intents(self, rows: list[dict]) -> None:
        """A blind append in ~2 ms, fsync'ed: on the wake-up's path."""
        if self._intents is None:
            # A direct append commits with link(), which S3 lacks: delta-rs there, as the
            # landing tables do (delta_tables/group_commit.py)
            self._intents = (DeltaAppendTarget(self.log_path, PUSH_LOG) if self.layout.remote
                             else DirectAppendTarget(self.log_path, PUSH_LOG))
        self._intents.commit(pa.Table.from_pylist(rows, schema=PUSH_LOG.arrow_schema()))

    def _append(self, rows: list[dict], marker: int | None = None) -> None:
        """Outcomes, with the marker when it advanced (delta-rs: the app transaction)."""
        t = pa.Table.from_pylist(rows, schema=PUSH_LOG.arrow_schema())
        props = (CommitProperties(app_transactions=[Transaction(APP_ID, marker)])
                 if marker is not None else None)
        dt = DeltaTable(str(self.log_path))
        write_deltalake(dt, t, mode="append", commit_properties=props)
        fsync_version(self.log_path, dt.version())

    async def _send_all(self, wakes: list[Wake], now: float) -> int:
        if not wakes:
            return 0
        now_us = _us(now)
        real, local = [], []
        for w in wakes:
            w.wake_at_us = self.unsure.pop(w.key, now_us)
            prov = self.providers.get(w.device.platform)
            (real if prov is not None and prov.configured else local).append(w)
        if real:
            # Before any request: a crash from here on re-sends, never forgets.
            await asyncio.to_thread(self._record_intents,
                                    [self._log_row(w, INTENT) for w in real])
        for w in wakes:
            self.planner.sent(w.key, now)
        for w in local:
            outcome = "dry_run" if w.device.platform in self.providers else "unsupported"
            self._finish(w, outcome, None, 0, None)
        for w in real:
            if w.version is not None:
                self.inflight[w.version] += 1
            task = asyncio.create_task(self._send(w), name="push-send")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(wakes)

    async def _send(self, w: Wake) -> None:
        prov = self.providers[w.device.platform]
        collapse = R.collapse_id(w.key, w.wake_at_us)
        attempts, refreshed = 0, False
        final, reason, latency = "retry_exhausted", None, None
        try:
            while True:
                attempts += 1
                async with self._sem:
                    t0 = time.monotonic()
                    try:
                        ans = await prov.send(w.device.token, collapse)
                    except Exception as e:      # a bug or a library's surprise: not retried
                        ans = Answer(Outcome.FAILED, f"error:{type(e).__name__}")
                    latency = time.monotonic() - t0
                if self.metrics is not None:
                    self.metrics.attempts.labels(w.device.platform, ans.outcome.value).inc()
                    self.metrics.latency.labels(w.device.platform).observe(latency)
                reason = ans.reason or None
                if ans.outcome is Outcome.RETRY:
                    if ans.refresh_credential and not refreshed:
                        refreshed = True
                        await prov.refresh()
                        continue
                    if attempts >= self.conf.max_attempts:
                        break
                    delay = (ans.retry_after if ans.retry_after is not None else backoff(
                        attempts, self.conf.retry_base_ms / 1000, self.conf.retry_max_ms / 1000))
                    await asyncio.sleep(min(delay, self.conf.retry_max_ms / 1000))
                    continue
                final = ans.outcome.value
                break
            if final == Outcome.UNREGISTERED.value:
                self.drops.append((w.protocol, w.device))
            self._finish(w, final, reason, attempts,
                         None if latency is None else int(latency * 1000))
        finally:
            if w.version is not None:
                self.inflight[w.version] -= 1
                if self.inflight[w.version] <= 0:
                    del self.inflight[w.version]

    def _finish(self, w: Wake, outcome: str, reason: str | None, attempts: int,
                latency_ms: int | None) -> None:
        self.done_rows.append(self._log_row(w, outcome, reason=reason, attempts=attempts,
                                            latency_ms=latency_ms, answered=self.clock()))
        self.stats.outcomes[(w.device.platform, outcome)] += 1
        if self.metrics is not None:
            self.metrics.wakeups.labels(w.device.platform, outcome).inc()
        if outcome not in ("sent", "dry_run"):
            log.info("push wake-up not delivered", extra={
                "event": "push_outcome", "platform": w.device.platform, "outcome": outcome,
                "reason": reason, "attempts": attempts, "protocol": w.protocol})

    async def _drop_dead(self) -> None:
        """Deregister the tokens providers called dead, through their owners' desks."""
        left = []
        for protocol, d in self.drops:
            try:
                await self.desks.drop(protocol, d.owner, d.platform, d.token)
                self.stats.drops += 1
            except DeskUnavailable:
                left.append((protocol, d))
        self.drops = left

    # --- progress ---------------------------------------------------------------------------
    def safe_version(self) -> int:
        """The highest inbox version all of whose rows are decided and answered."""
        low = [r.version for r in self.held] + list(self.inflight) + [
            v for _, _, v in self.deferred.values() if v is not None]
        return min([self.version] + [v - 1 for v in low])

    async def _commit_outcomes(self, force: bool = False) -> None:
        marker = self.safe_version()
        rows, self.done_rows = self.done_rows, []
        advance = marker > self.marker and (
            force or rows or time.monotonic() - self._marker_at >= MARKER_EVERY_SECONDS)
        if not rows and not advance:
            return
        try:
            await asyncio.to_thread(self._append, rows, marker if advance else None)
        except Exception:
            self.done_rows = rows + self.done_rows       # tried again next step
            raise
        if advance:
            self.marker, self._marker_at = marker, time.monotonic()

    # --- the loop ---------------------------------------------------------------------------
    def _next_wait(self, interval: float) -> float:
        due = self.planner.next_due()
        wait = interval if due is None else max(0.0, min(interval, due - self.clock()))
        return min(wait, 1.0) if (self.held or self.drops) else wait

    async def run(self, stop: asyncio.Event, on_started=None) -> None:
        """Until `stop`; `on_started()` once the job has restored its place."""
        await self.start()
        if on_started is not None:
            on_started()
        wake = None
        if self.settings.egress.inbox_signal:
            wake = await InboxSignal.open(signal_dir(self.settings.data_dir), "push")
        interval = self.settings.egress.poll_interval_ms / 1000
        failures = 0
        stopping = asyncio.ensure_future(stop.wait())
        if wake is not None:
            stopping.add_done_callback(lambda _: wake.poke())
        try:
            while not stop.is_set():
                try:
                    await self.step()
                    failures = 0
                except Exception as e:
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:
                        log.warning("push step failed", extra={
                            "event": "push_step_failed", "failures": failures,
                            "error": type(e).__name__})
                # Knocks are polled at least each second.
                timeout = min(1.0, self._next_wait(interval))
                if wake is not None:
                    await wake.wait(timeout)
                else:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout)
                    except asyncio.TimeoutError:
                        pass
        finally:
            stopping.cancel()
            if wake is not None:
                wake.close()
            await self.close()

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=DRAIN_SECONDS)
        for t in list(self._tasks):
            t.cancel()
        try:
            await self._commit_outcomes(force=True)
        except Exception as e:
            log.warning("push outcomes not recorded at stop", extra={
                "event": "push_stop_unrecorded", "error": type(e).__name__})
        self.desks.close()
        for prov in self.providers.values():
            await prov.close()


async def main(settings, stop: asyncio.Event, ready=None) -> None:
    """`relay push`: the job with its /metrics; ready once it has restored its place."""
    from runtime import metrics as M

    from .providers import providers
    push_metrics = M.PushMetrics(settings.data_dir)
    exporter = M.serve_role(settings, "push", push_metrics.registry)
    job = PushJob(settings, providers(settings.push, settings.data_dir), metrics=push_metrics)
    announce = M.announce(ready, exporter, settings.metrics.bind)
    try:
        await job.run(stop, on_started=(lambda: announce({})) if announce else None)
    finally:
        M.stop(exporter)
        log.info("push job stopped", extra={
            "event": "push_stopped", "rows": job.stats.rows,
            "outcomes": {f"{p}:{o}": n for (p, o), n in job.stats.outcomes.items()}})
