"""Prometheus metrics of every long-running relay process, declared once.

Each process serves its own registry on its own port (`[metrics]` in conf/relay.toml):

    relay ingress        :9701   pushes accepted / rejected, landing group commits, sessions
    relay egress         :9702   delivered, acked, pending, acks group commits, sessions
    relay stream         :9703   micro-batches, rows, accepted / rejected, rates, landing lag
    relay compact --loop :9704   runs, what they removed, bytes on disk
    relay push           :9708   wake-ups by platform and outcome, provider latency

Names are `relay_<subsystem>_<what>[_<unit>]`, counters end in `_total`; labels are only
`role`, `protocol`, `reason`, `table`, `listener`, `stage`, `kind`, `outcome`, `platform` — never a
mailbox, key, token, address or anything derived from an envelope. `METRICS` below is the
catalogue (README and `relay status` read it).

Hot paths do not touch Prometheus. Shells and jobs keep plain counters that were already there
or cost one integer add (`Listener.accepted / rejected / connections`, `MailboxHub.delivered_by
/ acked_by / pending_by_protocol()`, `GroupCommitAppender.commits / rows_committed /
failures`) and a collector reads them when `/metrics` is scraped. The two histograms are fed by
the callbacks the code paths offer (`GroupCommitAppender.on_commit`, `InboxSink.on_batch`).
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .listener import Listener

log = logging.getLogger("relay.metrics")

# name (as exposed) -> (type, labels, help). The single list of what the relay exports.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "relay_process_info": ("gauge", ("role", "data_dir"),
                           "1 for the role this process runs and its data directory"),
    # ingress
    "relay_ingress_accepted_total": (
        "counter", ("protocol",), "pushes acknowledged after their landing commit"),
    "relay_ingress_rejected_total": (
        "counter", ("protocol", "reason"),
        "pushes refused at ingress (short_body, oversize, store_failed)"),
    # ingress (table=landing) and egress (table=acks)
    "relay_commits_total": ("counter", ("table",), "group commits"),
    "relay_commit_rows_total": ("counter", ("table",), "rows in group commits"),
    "relay_commit_failures_total": ("counter", ("table",), "group commits that failed"),
    "relay_commit_latency_seconds": (
        "histogram", ("table",), "group commit latency: write, commit and fsync"),
    "relay_sessions_open": ("gauge", ("listener", "protocol"), "open client connections"),
    "relay_connections_held": (
        "gauge", ("listener", "stage"),
        "connections holding an admission slot, by stage (handshake, unauth, auth)"),
    "relay_connections_evicted_total": (
        "counter", ("listener",), "connections that lost their slot to a newcomer"),
    "relay_connections_refused_total": (
        "counter", ("listener",), "connections refused a slot (address cap, stage or total full)"),
    "relay_admission_decisions_total": (
        "counter", ("listener", "protocol", "stage", "reason"),
        "admission decisions (engine/admission.py) by stage: admitted; refused (address_cap, "
        "identity_cap, stage_full, total_full); evicted_<why> under the victim's stage "
        "(address_cap, identity_cap: its idlest session; stage_full, total_full)"),
    "relay_listener_pauses_total": (
        "counter", ("listener",), "times a listener stopped accepting near the descriptor limit"),
    # egress
    "relay_egress_delivered_total": (
        "counter", ("protocol",), "envelopes handed to a receive session"),
    "relay_egress_acked_total": (
        "counter", ("protocol",), "delivery acks durable in the acks table"),
    "relay_egress_pending": (
        "gauge", ("protocol",), "envelopes egress holds in memory, not yet acked"),
    "relay_egress_inbox_lag_versions": (
        "gauge", (), "inbox commits egress has not read yet"),
    "relay_egress_early_total": (
        "counter", ("protocol",), "envelopes taken from ingress before their inbox row"),
    "relay_egress_early_waiting": (
        "gauge", (), "early envelopes (held or acked) whose inbox rows have not arrived"),
    # the peer channel between hosts (runtime/peer_link.py): trueseal push ingress, egress
    "relay_peer_channels": ("gauge", (), "open peer channels of this process"),
    "relay_peer_handoffs_total": (
        "counter", ("result",), "hand-offs over peer channels: sent or dropped (a slow peer; "
        "its receivers get them from the inbox) by ingress, received by egress or a PPP "
        "listener"),
    "relay_peer_rejected_total": (
        "counter", (), "dialling hosts refused: their key is not listed for a live node"),
    # stream
    "relay_stream_batches_total": ("counter", (), "micro-batches committed"),
    "relay_stream_rows_total": ("counter", (), "landing rows read by micro-batches"),
    "relay_stream_accepted_total": ("counter", ("protocol",), "rows committed to the inbox"),
    "relay_stream_rejected_total": (
        "counter", ("reason",), "rows diverted to rejects (duplicate, expired, oversize)"),
    "relay_stream_batch_duration_seconds": (
        "histogram", (), "foreachBatch time per micro-batch: transform and Delta commits"),
    "relay_stream_input_rows_per_second": (
        "gauge", (), "rows of the last micro-batch / time since the trigger before it"),
    "relay_stream_processed_rows_per_second": (
        "gauge", (), "rows of the last micro-batch / its trigger time"),
    "relay_stream_trigger_duration_seconds": (
        "gauge", (), "Spark's whole trigger time of the last micro-batch"),
    "relay_landing_lag_versions": (
        "gauge", (), "landing commits the stream has not committed to the inbox"),
    "relay_landing_lag_seconds": (
        "gauge", (), "age of the oldest landing commit not yet in the inbox"),
    # compaction
    "relay_compaction_runs_total": ("counter", ("outcome",), "compaction runs (ok, failed)"),
    "relay_compaction_removed_total": (
        "counter", ("kind",), "what compaction removed (see jobs/compact.py)"),
    "relay_compaction_duration_seconds": ("gauge", (), "duration of the last compaction run"),
    "relay_compaction_last_success_timestamp_seconds": (
        "gauge", (), "unix time of the last compaction run that finished"),
    "relay_tables_bytes": ("gauge", (), "bytes under <data>/tables after the last run"),
    # push
    "relay_push_wakeups_total": (
        "counter", ("platform", "outcome"),
        "wake-ups by final outcome (sent, unregistered, failed, retry_exhausted, dry_run, "
        "unsupported)"),
    "relay_push_attempts_total": (
        "counter", ("platform", "outcome"), "provider requests by answer (sent, retry, ...)"),
    "relay_push_provider_latency_seconds": (
        "histogram", ("platform",), "one provider request, sent to answered"),
    "relay_push_inbox_lag_versions": (
        "gauge", (), "inbox versions committed that the push job has not read yet"),
}

COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _help(name: str) -> str:
    return METRICS[name][2]


def _family(kind: str, name: str, labels: Iterable[str] = ()) -> Metric:
    base = name[:-len("_total")] if name.endswith("_total") else name
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(base, _help(name), labels=list(labels))


class _Collect(Collector):
    """A collector from a function: read live objects when scraped."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]):
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        yield from self.fn()

    def describe(self) -> list[Metric]:
        return []   # nothing to check at registration: names come from METRICS


def new_registry(role: str, data_dir) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    g = Gauge("relay_process_info", _help("relay_process_info"), ["role", "data_dir"],
              registry=reg)
    # the data directory lets `relay status` tell its own relay from another on this host
    g.labels(role, str(Path(data_dir).resolve())).set(1)
    return reg


# --- building blocks ----------------------------------------------------------------------

class CommitMetrics:
    """Group commits of one process (`delta_tables.group_commit.GroupCommitAppender`)."""

    def __init__(self, registry: CollectorRegistry):
        self._watched: list[tuple[str, object]] = []
        self.latency = Histogram("relay_commit_latency_seconds",
                                 _help("relay_commit_latency_seconds"), ["table"],
                                 buckets=COMMIT_BUCKETS, registry=registry)
        registry.register(_Collect(self._collect))

    def watch(self, appender, table: str) -> None:
        hist = self.latency.labels(table)
        appender.on_commit = lambda result: hist.observe(result.seconds)
        self._watched.append((table, appender))

    def _collect(self) -> Iterator[Metric]:
        fams = {n: _family("counter", n, ["table"]) for n in (
            "relay_commits_total", "relay_commit_rows_total", "relay_commit_failures_total")}
        for table, ap in self._watched:
            fams["relay_commits_total"].add_metric([table], ap.commits)
            fams["relay_commit_rows_total"].add_metric([table], ap.rows_committed)
            fams["relay_commit_failures_total"].add_metric([table], ap.failures)
        yield from fams.values()


def listeners_of(node) -> list[Listener]:
    """Every protocol listener a node holds: a node adding a protocol is covered as is."""
    return [v for v in vars(node).values() if isinstance(v, Listener)]


def _listener_families(listeners: list[Listener]) -> Iterator[Metric]:
    """What every listener exports: its sessions, and its admission slots by stage."""
    fam = _family("gauge", "relay_sessions_open", ["listener", "protocol"])
    held = _family("gauge", "relay_connections_held", ["listener", "stage"])
    evicted = _family("counter", "relay_connections_evicted_total", ["listener"])
    refused = _family("counter", "relay_connections_refused_total", ["listener"])
    pauses = _family("counter", "relay_listener_pauses_total", ["listener"])
    decisions = _family("counter", "relay_admission_decisions_total",
                        ["listener", "protocol", "stage", "reason"])
    for lst in listeners:
        for (stage, reason), n in sorted(dict(lst.admission.decisions).items()):
            decisions.add_metric([lst.name, lst.protocol, stage, reason], n)
        fam.add_metric([lst.name, lst.protocol], lst.connections)
        for stage, n in lst.admission.counts().items():
            held.add_metric([lst.name, stage.name.lower()], n)
        evicted.add_metric([lst.name], lst.admission.evictions)
        refused.add_metric([lst.name], lst.admission.refusals)
        pauses.add_metric([lst.name], lst.pauses)
    yield from (fam, held, evicted, refused, pauses, decisions)


def _peer_families(channels_open: int, handoffs: dict[str, int],
                   rejected: int | None = None) -> Iterator[Metric]:
    """A process's side of the peer channel (runtime/peer_link.py)."""
    channels = _family("gauge", "relay_peer_channels")
    channels.add_metric([], channels_open)
    fam = _family("counter", "relay_peer_handoffs_total", ["result"])
    for result, n in handoffs.items():
        fam.add_metric([result], n)
    yield from (channels, fam)
    if rejected is not None:
        refused = _family("counter", "relay_peer_rejected_total")
        refused.add_metric([], rejected)
        yield refused


# --- per role -----------------------------------------------------------------------------

def ingress_registry(node, role: str = "ingress") -> CollectorRegistry:
    """`node`: ingress.service.IngressNode (its appender and listeners); `role`: ingress, or
    ingress-<protocol> for a process of one protocol."""
    reg = new_registry(role, node.settings.data_dir)
    CommitMetrics(reg).watch(node.appender, "landing")

    def collect() -> Iterator[Metric]:
        listeners = listeners_of(node)
        accepted = _family("counter", "relay_ingress_accepted_total", ["protocol"])
        rejected = _family("counter", "relay_ingress_rejected_total", ["protocol", "reason"])
        per_protocol: dict[str, int] = defaultdict(int)
        per_reason: dict[tuple[str, str], int] = defaultdict(int)
        for lst in listeners:
            per_protocol[lst.protocol] += lst.accepted
            for reason, n in dict(lst.rejected).items():
                per_reason[(lst.protocol, reason)] += n
        for p, n in sorted(per_protocol.items()):
            accepted.add_metric([p], n)
        for (p, r), n in sorted(per_reason.items()):
            rejected.add_metric([p, r], n)
        yield from (accepted, rejected)
        yield from _listener_families(listeners)
        peers, dialer = node.peers, getattr(node, "dialer", None)
        if peers is not None or dialer is not None:   # a PPP listener may be both ends
            handoffs = {"sent": peers.sent, "dropped": peers.dropped} if peers else {}
            if dialer is not None:
                handoffs["received"] = dialer.received
            yield from _peer_families(
                (len(peers.links) if peers else 0) + (len(dialer.links) if dialer else 0),
                handoffs, peers.rejected if peers else None)

    reg.register(_Collect(collect))
    return reg


def egress_registry(node) -> CollectorRegistry:
    """`node`: egress.service.EgressNode (hub, tail, acks appender, listeners)."""
    reg = new_registry("egress", node.settings.data_dir)
    CommitMetrics(reg).watch(node.acks, "acks")

    def collect() -> Iterator[Metric]:
        hub = node.hub
        protocols = sorted({lst.protocol for lst in listeners_of(node)}
                           | set(hub.delivered_by) | set(hub.acked_by))
        delivered = _family("counter", "relay_egress_delivered_total", ["protocol"])
        acked = _family("counter", "relay_egress_acked_total", ["protocol"])
        pending = _family("gauge", "relay_egress_pending", ["protocol"])
        held = hub.pending_by_protocol()
        d, a = dict(hub.delivered_by), dict(hub.acked_by)
        for p in protocols:
            delivered.add_metric([p], d.get(p, 0))
            acked.add_metric([p], a.get(p, 0))
            pending.add_metric([p], held.get(p, 0))
        lag = _family("gauge", "relay_egress_inbox_lag_versions")
        lag.add_metric([], node.tail.lag_versions)
        early = _family("counter", "relay_egress_early_total", ["protocol"])
        for p, n in sorted(dict(hub.early_taken_by).items()):
            early.add_metric([p], n)
        waiting = _family("gauge", "relay_egress_early_waiting")
        waiting.add_metric([], hub.early_waiting)
        yield from (delivered, acked, pending, lag, early, waiting)
        yield from _listener_families(listeners_of(node))
        if node.peers is not None:
            yield from _peer_families(len(node.peers.links), {"received": node.peers.received})

    reg.register(_Collect(collect))
    return reg


class StreamMetrics:
    """The inbox stream: fed by `InboxSink.on_batch` and the query's progress; `lag` is read
    at each scrape (`delta_tables.landing_lag.landing_lag` of the stream's checkpoint: anything
    with `versions` and `seconds`)."""

    def __init__(self, data_dir, lag: Callable[[], Any],
                 registry: CollectorRegistry | None = None):
        self.lag = lag
        self.registry = reg = registry or new_registry("stream", data_dir)

        def counter(name, labels=()):
            return Counter(name[:-len("_total")], _help(name), list(labels), registry=reg)

        def gauge(name):
            return Gauge(name, _help(name), registry=reg)

        self.batches = counter("relay_stream_batches_total")
        self.rows = counter("relay_stream_rows_total")
        self.accepted = counter("relay_stream_accepted_total", ["protocol"])
        self.rejected = counter("relay_stream_rejected_total", ["reason"])
        self.duration = Histogram("relay_stream_batch_duration_seconds",
                                  _help("relay_stream_batch_duration_seconds"),
                                  buckets=BATCH_BUCKETS, registry=reg)
        self.input_rate = gauge("relay_stream_input_rows_per_second")
        self.processed_rate = gauge("relay_stream_processed_rows_per_second")
        self.trigger_seconds = gauge("relay_stream_trigger_duration_seconds")
        self._rows_by_batch: dict[int, int] = {}
        self._last_progress: tuple[int, float] | None = None   # (batch id, trigger start)
        reg.register(_Collect(self._lag))

    def observe_batch(self, stats) -> None:
        """`InboxSink.on_batch` callback (jobs.inbox_stream.BatchStats)."""
        self.batches.inc()
        self.rows.inc(stats.rows_in)
        self._rows_by_batch[stats.batch_id] = stats.rows_in
        for old in [b for b in self._rows_by_batch if b < stats.batch_id - 100]:
            del self._rows_by_batch[old]
        for protocol, n in stats.accepted_by_protocol.items():
            self.accepted.labels(protocol).inc(n)
        for reason, n in stats.rejected.items():
            self.rejected.labels(reason).inc(n)
        self.duration.observe(stats.seconds)

    def observe_progress(self, progress) -> None:
        """A StreamingQueryProgress (dict) from `query.lastProgress` or a listener.

        The rates are Spark's definitions (rows / time since the previous trigger started;
        rows / this trigger's time) but with the sink's row count: Spark counts 0 input rows
        for a batch the sink read in the driver, without a Spark job (jobs/inbox_stream.py)."""
        if not progress or progress.get("batchId") is None:
            return
        batch = progress["batchId"]
        if self._last_progress is not None and self._last_progress[0] == batch:
            return
        rates = progress_rates(progress, self._rows_by_batch.get(batch),
                               self._last_progress[1] if self._last_progress else None)
        self.input_rate.set(rates.input_rows_per_second)
        self.processed_rate.set(rates.processed_rows_per_second)
        self.trigger_seconds.set(rates.trigger_seconds)
        self._last_progress = (batch, rates.started)

    def _lag(self) -> Iterator[Metric]:
        lag = self.lag()
        versions = _family("gauge", "relay_landing_lag_versions")
        versions.add_metric([], lag.versions)
        seconds = _family("gauge", "relay_landing_lag_seconds")
        seconds.add_metric([], lag.seconds)
        yield from (versions, seconds)


@dataclass
class BatchRates:
    rows: int
    started: float                  # unix seconds the trigger started
    trigger_seconds: float
    input_rows_per_second: float
    processed_rows_per_second: float


def batch_work_ms(duration_ms: dict | None) -> float:
    """A micro-batch's own time from Spark's `durationMs`: `triggerExecution` less
    `latestOffset`, which holds the source's wait for data and its pacing between batches
    (stream.wait_for_data_ms, delta_tables/landing_source.py), not work."""
    d = duration_ms or {}
    return max(0.0, float(d.get("triggerExecution", 0)) - float(d.get("latestOffset", 0)))


def progress_rates(progress, rows: int | None, previous_start: float | None) -> BatchRates:
    """Spark's input and processing rates of one progress event, computed with `rows` (the
    sink's count of the batch) when given, else with Spark's `numInputRows`."""
    from datetime import datetime
    rows = progress.get("numInputRows") or 0 if rows is None else rows
    started = datetime.fromisoformat(progress["timestamp"].replace("Z", "+00:00")).timestamp()
    trigger = batch_work_ms(progress.get("durationMs")) / 1000.0
    since = started - previous_start if previous_start is not None else None
    return BatchRates(rows, started, trigger,
                      rows / since if since and since > 0 else 0.0,
                      rows / trigger if trigger > 0 else 0.0)


class PushMetrics:
    """`relay push`: fed by `egress.push.job.PushJob`'s callbacks."""

    def __init__(self, data_dir, registry: CollectorRegistry | None = None):
        self.registry = reg = registry or new_registry("push", data_dir)
        self.wakeups = Counter("relay_push_wakeups", _help("relay_push_wakeups_total"),
                               ["platform", "outcome"], registry=reg)
        self.attempts = Counter("relay_push_attempts", _help("relay_push_attempts_total"),
                                ["platform", "outcome"], registry=reg)
        self.latency = Histogram("relay_push_provider_latency_seconds",
                                 _help("relay_push_provider_latency_seconds"), ["platform"],
                                 buckets=COMMIT_BUCKETS, registry=reg)
        self.lag = Gauge("relay_push_inbox_lag_versions",
                         _help("relay_push_inbox_lag_versions"), registry=reg)


class CompactionMetrics:
    """`relay compact --loop`: fed by `jobs.compact.compaction_loop`'s callbacks."""

    KINDS = ("tombstoned_acked", "expired_deleted", "acks_removed", "landing_dropped",
             "files_compacted", "files_vacuumed", "heya_inbox_deleted", "heya_inbox_trimmed",
             "heya_control_removed", "ppp_control_removed", "sync_control_removed",
             "push_log_removed")

    def __init__(self, data_dir, registry: CollectorRegistry | None = None):
        self.registry = reg = registry or new_registry("compact", data_dir)
        self.runs = Counter("relay_compaction_runs", _help("relay_compaction_runs_total"),
                            ["outcome"], registry=reg)
        self.removed = Counter("relay_compaction_removed", _help("relay_compaction_removed_total"),
                               ["kind"], registry=reg)
        for kind in self.KINDS:
            self.removed.labels(kind)
        self.duration = Gauge("relay_compaction_duration_seconds",
                              _help("relay_compaction_duration_seconds"), registry=reg)
        self.last_success = Gauge("relay_compaction_last_success_timestamp_seconds",
                                  _help("relay_compaction_last_success_timestamp_seconds"),
                                  registry=reg)
        self.bytes = Gauge("relay_tables_bytes", _help("relay_tables_bytes"), registry=reg)

    def observe(self, report) -> None:
        """A jobs.compact.CompactionReport."""
        self.runs.labels("ok").inc()
        for kind in self.KINDS:
            self.removed.labels(kind).inc(getattr(report, kind, 0))
        self.duration.set(report.seconds)
        self.last_success.set(time.time())
        self.bytes.set(report.bytes_after)

    def failed(self) -> None:
        self.runs.labels("failed").inc()


# --- serving and reading ------------------------------------------------------------------

def serve(registry: CollectorRegistry, host: str, port: int):
    """Serve `registry` on http://host:port/metrics in a daemon thread; returns the server
    (`server_port` is the bound port), or None when the configured port is 0 (off). A port
    that cannot be bound is logged and skipped: metrics must never keep a relay process from
    storing and delivering. Tests and notebooks use `serve_ephemeral`."""
    if port <= 0:
        return None
    return _start(registry, host, port)


def serve_role(settings, role: str, registry: CollectorRegistry):
    """Serve a role's registry where conf/ says (`[metrics]`, `RELAY_METRICS_PORT_<ROLE>`)."""
    return serve(registry, settings.metrics.bind, settings.metrics.port(role))


def stop(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def serve_ephemeral(registry: CollectorRegistry, host: str = "127.0.0.1"):
    """For tests and notebooks: any free port."""
    return _start(registry, host, 0)


def _start(registry: CollectorRegistry, host: str, port: int):
    try:
        server, _thread = start_http_server(port, host, registry)
    except OSError as exc:
        log.error("metrics endpoint not started", extra={
            "event": "metrics_unavailable", "port": port, "error": type(exc).__name__})
        return None
    log.info("metrics endpoint started", extra={"event": "metrics_started",
                                                "port": server.server_port})
    return server


def announce(ready, server, host: str):
    """Wrap a role's ready callback so the line it prints also says where metrics are."""
    if ready is None or server is None:
        return ready
    return lambda listening: ready({**listening, "metrics": f"{host}:{server.server_port}"})


@dataclass
class Sample:
    labels: dict[str, str]
    value: float


def scrape(url: str, timeout: float = 1.0) -> dict[str, list[Sample]]:
    """Read a /metrics endpoint into {sample name: samples}; raises OSError if unreachable."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, list[Sample]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append(Sample(dict(s.labels), s.value))
    return dict(out)


def total(samples: dict[str, list[Sample]], name: str, **match: str) -> float:
    return sum(s.value for s in samples.get(name, [])
               if all(s.labels.get(k) == v for k, v in match.items()))


def by_label(samples: dict[str, list[Sample]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for s in samples.get(name, []):
        out[s.labels.get(label, "")] += s.value
    return dict(out)


def histogram_quantile(samples: dict[str, list[Sample]], name: str, q: float,
                       **match: str) -> float | None:
    """Upper bound of the bucket holding quantile q (what Prometheus would interpolate)."""
    buckets = sorted(((float(s.labels["le"]), s.value) for s in samples.get(f"{name}_bucket", [])
                      if all(s.labels.get(k) == v for k, v in match.items())),
                     key=lambda b: b[0])
    if not buckets or buckets[-1][1] == 0:
        return None
    # several label sets (e.g. tables) share bounds: add them up per bound
    merged: dict[float, float] = defaultdict(float)
    for le, n in buckets:
        merged[le] += n
    bounds = sorted(merged)
    want = q * merged[bounds[-1]]
    for le in bounds:
        if merged[le] >= want:
            return le
    return bounds[-1]
