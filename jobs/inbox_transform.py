"""One micro-batch of landing rows -> inbox rows, rejects and padding-audit rows.

Two steps. **Decide**: each landing row's cursor (accepted) or reject reason (duplicate,
expired, oversize), with the batch time. The stream decides in Spark's state store
(`jobs/jvm/relay/stream/MailboxState.java`, wired by `jobs/stream_state.py`); `decide` here
is the same rules in Arrow/numpy over an `InboxState` in memory, for the processes that feed
the sink batches without Spark (`relay loadgen`, test harnesses) and as the executable
statement of the rules the JVM processor is checked against (tests/test_stream_state.py).
**Finish** (`finish`, shared): seqs, the TTL clamp, and the inbox, rejects and audit tables.

Dedup is per (protocol, mailbox, event id): an id is a duplicate within the mailbox it was
sent to, so the dedup state is partitioned by mailbox with the cursors, and one mailbox's
traffic can never suppress another's (PPP's event id does not bind the recipient).

Determinism is what makes replays exact: rows are in the fixed arrival order (received_at,
landing_table, landing_version, event_id, then protocol, mailbox and the bytes), and "now" is
the micro-batch timestamp Spark keeps in its offset log, so a replayed batch yields the same
result.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from delta_tables.schema import (
    C, INBOX, PADDING_AUDIT, REASON_DUPLICATE, REASON_EXPIRED, REASON_OVERSIZE, REJECTS,
)

_OK, _DUP, _EXPIRED, _OVERSIZE = 0, 1, 2, 3
_REASONS = {_DUP: REASON_DUPLICATE, _EXPIRED: REASON_EXPIRED, _OVERSIZE: REASON_OVERSIZE}
_HOUR_US = 3_600_000_000
_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class StreamRules:
    max_ttl_us: int
    buckets: tuple[int, ...] = (256, 1024, 4096, 16384)
    overhead: dict[str, int] = field(default_factory=dict)
    cursor_start: dict[str, int] = field(default_factory=dict)
    max_envelope: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_conf(cls, stream_conf, max_envelope: dict[str, int] | None = None) -> "StreamRules":
        return cls(max_ttl_us=stream_conf.max_ttl_seconds * 1_000_000,
                   buckets=tuple(sorted(stream_conf.padding_buckets)),
                   overhead=dict(stream_conf.padding_overhead),
                   cursor_start=dict(stream_conf.cursor_start),
                   max_envelope=dict(max_envelope or {}))

    def first_cursor(self, protocol: str) -> int:
        return self.cursor_start.get(protocol, 1)


@dataclass
class InboxState:
    """`decide`'s memory between batches: dedup keys still within TTL, the last cursor per
    mailbox, the last relay-wide seq. ~170 B per live key in a Python dict: fine for a
    harness, the reason the stream keeps this in Spark's state store instead."""
    seen: dict[bytes, int] = field(default_factory=dict)   # dedup_keys() -> expires_at µs
    last_cursor: dict[tuple[str, bytes], int] = field(default_factory=dict)
    last_seq: int = 0
    _by_hour: dict[int, list[bytes]] = field(default_factory=lambda: defaultdict(list))

    def remember(self, event_id: bytes, expires_us: int) -> None:
        self.seen[event_id] = expires_us
        self._by_hour[expires_us // _HOUR_US].append(event_id)

    def evict(self, now_us: int) -> int:
        """Forget event ids whose TTL has passed: a retry after expiry is a new envelope."""
        dropped = 0
        for hour in [h for h in self._by_hour if h <= now_us // _HOUR_US]:
            keep = []
            for e in self._by_hour.pop(hour):
                exp = self.seen.get(e)
                if exp is None:
                    continue
                if exp <= now_us:
                    del self.seen[e]
                    dropped += 1
                else:
                    keep.append(e)
            if keep:
                self._by_hour[hour].extend(keep)
        return dropped

    def apply(self, result: "BatchResult") -> None:
        """The batch's cursors and seq, and `remember` for each accepted row, a batch at a
        time."""
        self.last_cursor.update(result.cursors)
        self.last_seq = max(self.last_seq, result.last_seq)
        ids = result.event_ids
        if not ids:
            return
        exps = _micros(result.inbox.column(C.EXPIRES_AT))
        self.seen.update(zip(ids, exps.tolist()))
        hours = exps // _HOUR_US
        if hours[0] == hours[-1] and (hours == hours[0]).all():   # the usual: one hour
            self._by_hour[int(hours[0])].extend(ids)
            return
        by_hour = np.argsort(hours, kind="stable")
        bounds = np.flatnonzero(np.diff(hours[by_hour])) + 1
        objects = np.array(ids, dtype=object)
        for part in np.split(by_hour, bounds):
            self._by_hour[int(hours[part[0]])].extend(objects[part].tolist())


@dataclass
class BatchResult:
    inbox: pa.Table
    rejects: pa.Table
    audit: pa.Table
    cursors: dict[tuple[str, bytes], int]
    last_seq: int
    event_ids: list[bytes]   # dedup_keys() of the inbox rows (transform fills them)


def _micros(col) -> np.ndarray:
    return pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False)


def _ts(values: np.ndarray) -> pa.Array:
    return pa.array(values, pa.int64()).cast(pa.timestamp("us", tz="UTC"))


def _one_chunk(col) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _codes(col) -> tuple[np.ndarray, list]:
    """(each row's index into the distinct values, the distinct values): per-value work is
    then done once per distinct value (a protocol, a mailbox), not once per row."""
    enc = pc.dictionary_encode(_one_chunk(col))
    return (enc.indices.to_numpy(zero_copy_only=False).astype(np.int64),
            enc.dictionary.to_pylist())


def _per_protocol(col, values: dict[str, int], default: int) -> np.ndarray:
    idx, protocols = _codes(col)
    return np.array([values.get(p, default) for p in protocols], np.int64)[idx]


ARRIVAL = (C.RECEIVED_AT, C.LANDING_TABLE, C.LANDING_VERSION, C.EVENT_ID, C.PROTOCOL, C.MAILBOX,
           C.ENVELOPE, C.META)
BATCH_MS = "batch_ms"     # the decided rows' batch time (ms), as Spark's offset log has it


def _arrival_order(batch: pa.Table) -> np.ndarray | None:
    """Indices that put `batch` in the fixed arrival order (module docstring); None when it is
    in that order already, as it usually is: then nothing is copied to reorder it."""
    order = pc.sort_indices(batch.select(list(ARRIVAL)),
                            sort_keys=[(k, "ascending") for k in ARRIVAL])
    order = order.to_numpy(zero_copy_only=False)
    return None if np.array_equal(order, np.arange(batch.num_rows)) else order


def order_rows(batch: pa.Table) -> pa.Table:
    """`batch` in the fixed arrival order used for cursors and seqs (module docstring)."""
    order = _arrival_order(batch)
    return batch if order is None else batch.take(pa.array(order, pa.int64()))


def dedup_keys(batch: pa.Table) -> pa.Array:
    """event id, mailbox and protocol joined by NULs: the dedup key (module docstring) as one
    value (the event id has a fixed length and the protocol no NUL, so it is unambiguous)."""
    return pc.binary_join_element_wise(
        _one_chunk(batch.column(C.EVENT_ID)), _one_chunk(batch.column(C.MAILBOX)),
        _one_chunk(batch.column(C.PROTOCOL)).cast(pa.binary()), b"\0")


def _cursors(protocol_idx: np.ndarray, protocols: list, mailbox_col, state: InboxState,
             rules: StreamRules) -> np.ndarray:
    """Each accepted row's cursor, in arrival order: gap-free per (protocol, mailbox),
    continuing from `state`. The rows of one mailbox are ranked with numpy; only the start of
    each distinct mailbox is looked up in Python."""
    n = len(protocol_idx)
    if n == 0:
        return np.empty(0, np.int64)
    mailbox_idx, mailboxes = _codes(mailbox_col)
    width = len(mailboxes)
    key = protocol_idx * width + mailbox_idx
    uniq, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    names = [(protocols[k // width], mailboxes[k % width]) for k in uniq.tolist()]
    last = np.array([state.last_cursor.get(name, rules.first_cursor(name[0]) - 1)
                     for name in names], np.int64)
    by_key = np.argsort(inverse, kind="stable")     # arrival order within each mailbox
    rank = np.empty(n, np.int64)
    rank[by_key] = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return last[inverse] + rank + 1


def decide(batch: pa.Table, state: InboxState, rules: StreamRules,
           batch_ts: datetime) -> pa.Table:
    """`batch` in arrival order with each row's cursor or reason and the batch time: the
    rules of MailboxState.java over `state` (which is not changed)."""
    now_us = int(batch_ts.timestamp() * 1_000_000)
    batch = order_rows(batch)
    n = batch.num_rows
    size = pc.binary_length(batch.column(C.ENVELOPE)).to_numpy(
        zero_copy_only=False).astype(np.int64)
    protocol_idx, protocols = _codes(batch.column(C.PROTOCOL))
    exp = _micros(batch.column(C.EXPIRES_AT))

    code = np.zeros(n, np.int8)
    if rules.max_envelope:
        limit = np.array([rules.max_envelope.get(p, _INT64_MAX) for p in protocols], np.int64)
        code[size > limit[protocol_idx]] = _OVERSIZE
    code[(code == _OK) & (exp <= now_us)] = _EXPIRED
    # Duplicates: a later row of a key this batch accepts, or any row of a key the state
    # holds unexpired (an expired id is forgotten). Arrow hashes the keys; Python looks up
    # each distinct key once, in the order of its first row.
    ok = np.flatnonzero(code == _OK)
    first_of, distinct = _codes(dedup_keys(batch).take(pa.array(ok, pa.int64())))
    first = np.unique(first_of, return_index=True)[1]     # ascending: codes follow first rows
    seen = state.seen
    live = np.fromiter((seen.get(e, 0) > now_us for e in distinct), np.bool_, len(distinct)) \
        if seen else np.zeros(len(distinct), np.bool_)
    acc = ok[first[~live]]
    code[ok] = _DUP
    code[acc] = _OK

    cursor = np.zeros(n, np.int64)
    cursor[acc] = _cursors(protocol_idx[acc], protocols,
                           _one_chunk(batch.column(C.MAILBOX)).take(pa.array(acc)), state, rules)
    reason = pa.array([_REASONS.get(int(c)) for c in code], pa.string())
    return (batch.append_column(C.CURSOR, pa.array(cursor, pa.int64(), mask=code != _OK))
            .append_column(C.REASON, reason)
            .append_column(BATCH_MS, pa.array(np.full(n, now_us // 1000, np.int64))))


def finish(decided: pa.Table, last_seq: int, rules: StreamRules, batch_id: int,
           now_us: int | None = None, in_order: bool = False) -> BatchResult:
    """Seqs (relay-wide, in arrival order, after `last_seq`), the TTL clamp and the three
    tables, from decided rows in any order. The rows (envelopes) are copied once, to the
    inbox's and the rejects' tables, and not at all when every row came accepted in order."""
    n = decided.num_rows
    if now_us is None:   # Spark's batch time is in ms; a caller's own may be finer
        now_us = int(decided.column(BATCH_MS)[0].as_py()) * 1000 if n else 0
    order = None if in_order else _arrival_order(decided)   # `decide` has ordered them
    if order is not None:
        decided = decided.take(pa.array(order, pa.int64()))
    accepted = pc.is_null(decided.column(C.REASON)).to_numpy(zero_copy_only=False)
    a = decided if accepted.all() else decided.filter(pa.array(accepted))
    r = decided.filter(pa.array(~accepted)) if not accepted.all() else decided.slice(0, 0)
    na, nr = a.num_rows, r.num_rows
    seq = last_seq + 1 + np.arange(na, dtype=np.int64)
    clamped = np.minimum(_micros(a.column(C.EXPIRES_AT)),
                         _micros(a.column(C.RECEIVED_AT)) + rules.max_ttl_us)
    inbox = pa.Table.from_arrays([
        a.column(C.EVENT_ID), a.column(C.PROTOCOL), a.column(C.MAILBOX), a.column(C.ENVELOPE),
        a.column(C.META), a.column(C.RECEIVED_AT), _ts(clamped),
        a.column(C.CURSOR), pa.array(seq, pa.int64()),
        _ts(np.full(na, now_us, np.int64)), a.column(C.LANDING_TABLE),
        a.column(C.LANDING_VERSION), pa.array(np.full(na, batch_id, np.int64)),
    ], schema=INBOX.arrow_schema())
    rejects = pa.Table.from_arrays([
        r.column(C.EVENT_ID), r.column(C.PROTOCOL), r.column(C.MAILBOX),
        pc.cast(pc.binary_length(r.column(C.ENVELOPE)), pa.int64()), r.column(C.REASON),
        r.column(C.RECEIVED_AT), _ts(np.full(nr, now_us, np.int64)),
        r.column(C.LANDING_TABLE), r.column(C.LANDING_VERSION),
        pa.array(np.full(nr, batch_id, np.int64)),
    ], schema=REJECTS.arrow_schema())
    size = pc.binary_length(a.column(C.ENVELOPE)).to_numpy(zero_copy_only=False).astype(np.int64)
    return BatchResult(inbox, rejects, padding_audit(a, size, rules, batch_id, now_us),
                       {}, int(seq[-1]) if na else last_seq, [])


def transform(batch: pa.Table, state: InboxState, rules: StreamRules, batch_id: int,
              batch_ts: datetime) -> BatchResult:
    """`decide` over `state`, then `finish`; with what `InboxState.apply` needs to remember."""
    result = finish(decide(batch, state, rules, batch_ts), state.last_seq, rules, batch_id,
                    int(batch_ts.timestamp() * 1_000_000), in_order=True)
    inbox = result.inbox
    if inbox.num_rows:
        last = inbox.group_by([C.PROTOCOL, C.MAILBOX], use_threads=False).aggregate(
            [(C.CURSOR, "max")])
        result.cursors = dict(zip(zip(last.column(C.PROTOCOL).to_pylist(),
                                      last.column(C.MAILBOX).to_pylist()),
                                  last.column(f"{C.CURSOR}_max").to_pylist()))
        result.event_ids = dedup_keys(inbox).to_pylist()
    return result


def padding_audit(accepted: pa.Table, size: np.ndarray, rules: StreamRules, batch_id: int,
                  now_us: int) -> pa.Table:
    """Rows per (protocol, exact payload size): payload = envelope - protocol overhead; the
    bucket is the smallest that holds it (null past the largest); conforming = exactly a bucket,
    i.e. the sender padded as the scheme says."""
    schema = PADDING_AUDIT.arrow_schema()
    if accepted.num_rows == 0:
        return schema.empty_table()
    protocols = accepted.column(C.PROTOCOL)
    payload = size - _per_protocol(protocols, rules.overhead, 0)
    grouped = pa.table({"p": protocols, "s": pa.array(payload, pa.int64()),
                        "b": pa.array(size, pa.int64())}).group_by(["p", "s"], use_threads=False) \
        .aggregate([("b", "count"), ("b", "sum")]).sort_by([("p", "ascending"), ("s", "ascending")])
    sizes = grouped.column("s").to_numpy()
    buckets = np.array(rules.buckets, np.int64)
    pos = np.searchsorted(buckets, sizes, side="left")
    fits = pos < len(buckets)
    bucket = np.where(fits, buckets[np.minimum(pos, len(buckets) - 1)], 0)
    m = grouped.num_rows
    return pa.Table.from_arrays([
        pa.array(np.full(m, batch_id, np.int64)), grouped.column("p"), grouped.column("s"),
        pa.array(bucket.astype(np.int32), pa.int32(), mask=~fits),
        pa.array(fits & (bucket == sizes)), grouped.column("b_count"), grouped.column("b_sum"),
        _ts(np.full(m, now_us, np.int64)),
    ], schema=schema)
