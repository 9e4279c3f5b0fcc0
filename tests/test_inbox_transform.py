"""The stream's pure transform: dedup, cursors, seq, TTL clamp, rejects, padding audit."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa
from chispa import assert_df_equality

from delta_tables.schema import C, LANDING_SOURCE
from jobs.inbox_transform import InboxState, StreamRules, transform

from landing_rows import landing_row

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
RULES = StreamRules(max_ttl_us=30 * 86400 * 10**6, cursor_start={"heya": 0},
                    max_envelope={"trueseal": 65482}, overhead={"trueseal": 0})
A, B = b"A" * 32, b"B" * 32


def batch(rows, table="node-t/g000001", version=1):
    for r in rows:
        r[C.LANDING_TABLE] = table
        r[C.LANDING_VERSION] = version
    return pa.Table.from_pylist(rows, schema=LANDING_SOURCE.arrow_schema())


def at(seconds):
    return T0 + timedelta(seconds=seconds)


def test_dedup_cursor_seq_and_rejects():
    rows = [
        landing_row(A, b"a1" * 128, received_at=at(1)),
        landing_row(B, b"b1" * 128, received_at=at(2)),
        landing_row(A, b"a1" * 128, received_at=at(3)),                   # retry: duplicate
        landing_row(A, b"a2" * 128, received_at=at(4)),
        landing_row(A, b"old" * 10, received_at=at(0), expires_at=at(5)),  # expired at batch time
        landing_row(B, b"x" * 65483, received_at=at(6)),                  # over the limit
    ]
    state = InboxState(last_cursor={("trueseal", A): 7}, last_seq=100)
    state.remember(b"\x01" * 32, int(at(10**6).timestamp() * 1e6))
    out = transform(batch(rows), state, RULES, batch_id=3, batch_ts=at(10))
    got = [(r[C.MAILBOX], r[C.CURSOR], r[C.SEQ]) for r in out.inbox.to_pylist()]
    assert got == [(A, 8, 101), (B, 1, 102), (A, 9, 103)]
    reasons = sorted(out.rejects.column(C.REASON).to_pylist())
    assert reasons == ["duplicate", "expired", "oversize"]
    assert out.cursors == {("trueseal", A): 9, ("trueseal", B): 1}
    assert set(out.inbox.column(C.BATCH_ID).to_pylist()) == {3}


def test_history_dedup_and_state_apply():
    row = landing_row(A, b"same" * 64, received_at=at(1))
    state = InboxState()
    first = transform(batch([dict(row)]), state, RULES, 0, at(2))
    state.apply(first)
    again = transform(batch([dict(row)], version=2), state, RULES, 1, at(3))
    assert again.inbox.num_rows == 0
    assert again.rejects.column(C.REASON).to_pylist() == ["duplicate"]
    # after its TTL the id is forgotten: a new envelope with the same bytes is accepted
    state.evict(int((at(1) + timedelta(days=2)).timestamp() * 1e6))
    assert state.seen == {}


def test_ttl_is_clamped_to_thirty_days_after_receipt():
    row = landing_row(A, b"t" * 256, received_at=at(0), ttl=timedelta(days=90))
    out = transform(batch([row]), InboxState(), RULES, 0, at(1))
    assert out.inbox.column(C.EXPIRES_AT)[0].as_py() == at(0) + timedelta(days=30)


def test_heya_cursors_start_at_zero():
    rows = [landing_row(A, bytes([i]) * 300, protocol="heya", received_at=at(i)) for i in range(3)]
    out = transform(batch(rows), InboxState(), RULES, 0, at(5))
    assert out.inbox.column(C.CURSOR).to_pylist() == [0, 1, 2]


def test_padding_audit_buckets():
    sizes = [256, 256, 300, 1024, 20000]
    rows = [landing_row(A, bytes([i]) * s, received_at=at(i)) for i, s in enumerate(sizes)]
    audit = transform(batch(rows), InboxState(), RULES, 0, at(9)).audit.to_pylist()
    got = {(r[C.PAYLOAD_SIZE], r[C.BUCKET], r[C.CONFORMING], r[C.ENVELOPES]) for r in audit}
    assert got == {(256, 256, True, 2), (300, 1024, False, 1), (1024, 1024, True, 1),
                   (20000, None, False, 1)}


def test_order_is_deterministic_across_files():
    # same received_at: the landing table, then its version, then the row position decide
    rows1 = [landing_row(A, b"x" * 256, received_at=at(1))]
    rows2 = [landing_row(A, b"y" * 256, received_at=at(1))]
    t = pa.concat_tables([batch(rows2, "node-u/g000001", 1), batch(rows1, "node-t/g000001", 9)])
    out1 = transform(t, InboxState(), RULES, 0, at(2))
    out2 = transform(t.take([1, 0]), InboxState(), RULES, 0, at(2))
    assert out1.inbox.equals(out2.inbox)
    assert out1.inbox.column(C.ENVELOPE)[0].as_py() == b"x" * 256


def test_transform_of_a_spark_dataframe(spark):
    """The stream hands the transform `batch_df.toArrow()`: check the round trip with chispa."""
    rows = [landing_row(m, bytes([i]) * 256, received_at=at(i))
            for i, m in enumerate([A, B, A, A, B])]
    df = spark.createDataFrame(batch(rows))
    out = transform(df.toArrow(), InboxState(), RULES, 0, at(9))
    actual = spark.createDataFrame(out.inbox.select([C.MAILBOX, C.CURSOR]))
    expected = spark.createDataFrame([(A, 1), (B, 1), (A, 2), (A, 3), (B, 2)],
                                     actual.schema)
    assert_df_equality(actual, expected)


def test_an_expired_id_is_not_a_duplicate_even_before_eviction():
    """The first batch after an idle spell runs before `evict`: a resend of an envelope whose
    TTL has passed is a new envelope then too, not a duplicate."""
    row = landing_row(A, b"same" * 64, received_at=at(1), ttl=timedelta(hours=1))
    state = InboxState()
    state.apply(transform(batch([dict(row)]), state, RULES, 0, at(2)))
    resent = dict(row, **{C.RECEIVED_AT: at(7200), C.EXPIRES_AT: at(7200 + 3600)})
    out = transform(batch([resent], version=2), state, RULES, 1, at(7201))   # no evict yet
    assert out.rejects.num_rows == 0
    assert [r[C.CURSOR] for r in out.inbox.to_pylist()] == [2]


def dedup_key(r: dict) -> bytes:
    """jobs.inbox_transform.dedup_keys for one row: event id, mailbox and protocol, NUL between."""
    return b"\0".join((r[C.EVENT_ID], r[C.MAILBOX], r[C.PROTOCOL].encode()))


def _reference(rows: list[dict], state: InboxState, rules: StreamRules, now_us: int):
    """The rules one row at a time, as plainly as they can be said: what the vectorised
    transform must agree with."""
    def us(t):
        return int(t.timestamp() * 1_000_000)
    ordered = sorted(enumerate(rows), key=lambda ir: (
        ir[1][C.RECEIVED_AT], ir[1][C.LANDING_TABLE], ir[1][C.LANDING_VERSION],
        ir[1][C.EVENT_ID], ir[1][C.PROTOCOL], ir[1][C.MAILBOX], ir[1][C.ENVELOPE],
        ir[1][C.META] or b"", ir[0]))
    seen, last = dict(state.seen), dict(state.last_cursor)
    seq, inbox, rejects = state.last_seq, [], []
    for _, r in ordered:
        p, e = r[C.PROTOCOL], r[C.EVENT_ID]
        key = dedup_key(r)               # a duplicate within its own mailbox only
        if len(r[C.ENVELOPE]) > rules.max_envelope.get(p, float("inf")):
            rejects.append((e, "oversize"))
        elif us(r[C.EXPIRES_AT]) <= now_us:
            rejects.append((e, "expired"))
        elif seen.get(key, 0) > now_us:
            rejects.append((e, "duplicate"))
        else:
            seen[key] = 1 << 62
            box = (p, r[C.MAILBOX])
            last[box] = last.get(box, rules.first_cursor(p) - 1) + 1
            seq += 1
            inbox.append((e, p, r[C.MAILBOX], r[C.ENVELOPE], last[(p, r[C.MAILBOX])], seq, min(
                us(r[C.EXPIRES_AT]), us(r[C.RECEIVED_AT]) + rules.max_ttl_us)))
    cursors = {k: v for k, v in last.items() if state.last_cursor.get(k) != v}
    return inbox, rejects, cursors, seq


def test_the_vectorised_transform_agrees_with_the_rules_row_by_row():
    """Random batches over few ids, mailboxes, protocols, files and times, so that every
    rule meets the others: duplicates within the batch and against the state (live and
    expired), expired and oversize rows, cursors continuing from the state and starting at
    each protocol's first cursor, rows in and out of arrival order across files and chunks."""
    import random

    rules = StreamRules(max_ttl_us=3600 * 10**6, cursor_start={"heya": 0},
                        max_envelope={"trueseal": 300}, overhead={"ppp": 40})
    rnd = random.Random(13)
    now = at(1000)
    now_us = int(now.timestamp() * 1_000_000)
    for trial in range(60):
        ids = [bytes([rnd.randrange(256)]) * 32 for _ in range(rnd.choice((3, 40, 400)))]
        mailboxes = [bytes([i]) * 32 for i in range(rnd.choice((1, 3, 50)))]
        rows = []
        for _ in range(rnd.choice((1, 5, 200))):
            recv = at(rnd.randrange(990, 1000))
            row = landing_row(rnd.choice(mailboxes), b"e" * rnd.choice((256, 300, 301, 1024)),
                              protocol=rnd.choice(("trueseal", "heya", "ppp")),
                              event_id=rnd.choice(ids), received_at=recv,
                              expires_at=recv + timedelta(seconds=rnd.choice((5, 60, 7200))))
            row[C.LANDING_TABLE] = rnd.choice(("n-a/g000001", "n-b/g000001"))
            row[C.LANDING_VERSION] = rnd.randrange(3)
            rows.append(row)
        if trial % 2:   # in arrival order already, as landing usually is: nothing to reorder
            rows.sort(key=lambda r: (r[C.RECEIVED_AT], r[C.LANDING_TABLE], r[C.LANDING_VERSION]))
        state = InboxState(last_seq=rnd.randrange(100))
        for m in rnd.sample(mailboxes, len(mailboxes) // 2):
            state.last_cursor[(rnd.choice(("trueseal", "heya")), m)] = rnd.randrange(1, 9)
        for e in rnd.sample(ids, len(ids) // 3):
            state.remember(dedup_key({C.EVENT_ID: e, C.MAILBOX: rnd.choice(mailboxes),
                                      C.PROTOCOL: rnd.choice(("trueseal", "heya", "ppp"))}),
                           now_us + rnd.choice((-1, 0, 1)) * 10**6)
        t = pa.Table.from_pylist(rows, schema=LANDING_SOURCE.arrow_schema())
        if len(rows) > 2:   # several chunks, as read_files hands them over
            t = pa.concat_tables([t.slice(0, len(rows) // 2), t.slice(len(rows) // 2)])
        out = transform(t, state, rules, batch_id=trial, batch_ts=now)
        inbox, rejects, cursors, last_seq = _reference(rows, state, rules, now_us)
        got = [(r[C.EVENT_ID], r[C.PROTOCOL], r[C.MAILBOX], r[C.ENVELOPE], r[C.CURSOR],
                r[C.SEQ], int(r[C.EXPIRES_AT].timestamp() * 1_000_000))
               for r in out.inbox.to_pylist()]
        assert got == inbox, trial
        assert sorted(zip(out.rejects.column(C.EVENT_ID).to_pylist(),
                          out.rejects.column(C.REASON).to_pylist())) == sorted(rejects), trial
        assert out.cursors == cursors and (out.last_seq == last_seq), trial
        by_size: dict = {}
        for _, p, _, env, *_ in inbox:
            key = (p, len(env) - rules.overhead.get(p, 0))
            by_size[key] = by_size.get(key, 0) + 1
        assert {(r[C.PROTOCOL], r[C.PAYLOAD_SIZE]): r[C.ENVELOPES]
                for r in out.audit.to_pylist()} == by_size, trial
        # apply == remember row by row
        one_by_one = InboxState(seen=dict(state.seen))
        for h, v in state._by_hour.items():
            one_by_one._by_hour[h] = list(v)
        for e, p, m, *_, exp in inbox:
            one_by_one.remember(dedup_key({C.EVENT_ID: e, C.MAILBOX: m, C.PROTOCOL: p}), exp)
        state.apply(out)
        assert state.seen == one_by_one.seen, trial
        assert {h: sorted(v) for h, v in state._by_hour.items()} == \
            {h: sorted(v) for h, v in one_by_one._by_hour.items()}, trial
