"""The stream's dedup index and cursors in Spark's state store (jobs/stream_state.py and
jobs/jvm/relay/stream/MailboxState.java), through real Structured Streaming: the JVM
processor agrees with the rules as `jobs.inbox_transform.decide` states them, a restart
restores the state from the checkpoint without reading an inbox row, and a new checkpoint over
an inbox with rows starts from the inbox."""

from __future__ import annotations

import os
import random
import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from chispa import assert_df_equality
from deltalake import DeltaTable

from delta_tables.schema import C, LANDING_SOURCE
from jobs.inbox_stream import start_inbox_stream
from jobs.inbox_transform import BATCH_MS, InboxState, StreamRules, decide, transform
from jobs.stream_state import decided

from landing_rows import envelope, land, landing_row

MB = [bytes([i]) * 32 for i in range(1, 6)]
KEYS = [C.EVENT_ID, C.PROTOCOL, C.MAILBOX, C.CURSOR, C.REASON]


def _random_batches(rnd: random.Random, now: datetime, n_batches: int) -> list[pa.Table]:
    """Few ids, mailboxes and protocols, so every rule meets the others: duplicates within
    a batch, across batches and across mailboxes (not duplicates: dedup is per mailbox),
    expired and oversize rows, each protocol's first cursor, rows out of order."""
    ids = [rnd.randbytes(32) for _ in range(40)]
    batches = []
    for b in range(n_batches):
        rows = []
        for _ in range(rnd.choice((5, 120))):
            recv = now - timedelta(seconds=rnd.randrange(0, 30))
            row = landing_row(rnd.choice(MB[:3]), b"e" * rnd.choice((256, 300, 301, 1024)),
                              protocol=rnd.choice(("trueseal", "heya", "ppp")),
                              event_id=rnd.choice(ids), received_at=recv,
                              expires_at=recv + timedelta(seconds=rnd.choice((-60, 3600, 10**7))))
            row[C.LANDING_TABLE] = rnd.choice(("n-a/g000001", "n-b/g000001"))
            row[C.LANDING_VERSION] = b * 10 + rnd.randrange(3)
            rows.append(row)
        batches.append(pa.Table.from_pylist(rows, schema=LANDING_SOURCE.arrow_schema()))
    return batches


def test_the_jvm_processor_agrees_with_the_rules(spark, tmp_path):
    """Three micro-batches through the JVM processor (a file stream, a file a batch) and the
    same batches through `decide` over an InboxState that remembers as the sink does: every
    row gets the same cursor or reason, at the batch time Spark gave it."""
    rules = StreamRules(max_ttl_us=3600 * 10**6, cursor_start={"heya": 0},
                        max_envelope={"trueseal": 300}, overhead={"ppp": 40})
    batches = _random_batches(random.Random(7), datetime.now(timezone.utc), 3)
    src = tmp_path / "in"
    src.mkdir()
    for i, t in enumerate(batches):
        pq.write_table(t, src / f"part-{i:03d}.parquet")
        # Spark's file source takes files in modification time order, ties in listing order:
        # a second apart, batch i is file i
        stamp = time.time() - 10 + i
        os.utime(src / f"part-{i:03d}.parquet", (stamp, stamp))
    got: list[pa.Table] = []
    stream = (spark.readStream.schema(LANDING_SOURCE.spark_schema())
              .option("maxFilesPerTrigger", 1).parquet(str(src)))
    query = (decided(stream, rules).writeStream
             .foreachBatch(lambda df, _id: got.append(df.toArrow()))
             .option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    assert query.exception() is None
    assert len(got) == 3

    state = InboxState()
    for i, (batch, jvm) in enumerate(zip(batches, got)):
        batch_ts = datetime.fromtimestamp(jvm.column(BATCH_MS)[0].as_py() / 1000, timezone.utc)
        expected = decide(batch, state, rules, batch_ts)
        state.apply(transform(batch, state, rules, i, batch_ts))
        actual = spark.createDataFrame(jvm.select(KEYS)).orderBy(*KEYS)
        want = spark.createDataFrame(expected.select(KEYS), actual.schema).orderBy(*KEYS)
        assert_df_equality(actual, want)
    reasons = set().union(*(t.column(C.REASON).to_pylist() for t in got))
    assert {"duplicate", "expired", "oversize", None} <= reasons   # every rule was met


def _inbox(layout):
    return DeltaTable(str(layout.inbox)).to_pyarrow_table()


def _run(spark, settings):
    settings.stream.state_store = True
    query, sink = start_inbox_stream(spark, settings, available_now=True, fsync=False)
    query.awaitTermination(300)
    assert query.exception() is None
    return sink


def _per_mailbox(inbox) -> dict:
    per: dict = {}
    for r in inbox.select([C.PROTOCOL, C.MAILBOX, C.CURSOR]).to_pylist():
        per.setdefault((r[C.PROTOCOL], r[C.MAILBOX]), []).append(r[C.CURSOR])
    return per


def test_a_restart_restores_state_from_the_checkpoint_not_the_inbox(spark, settings, layout,
                                                                     tmp_path):
    """Between two runs on one checkpoint the inbox's data files are moved away (its log
    stays): the second run can only continue the cursors, the seqs and the dedup index from
    the state store and the log. With the files back, the inbox is whole and gap-free."""
    rows = [landing_row(MB[i % 3], envelope(i)) for i in range(60)]
    land(layout, rows, per_commit=20)
    _run(spark, settings)
    first = _inbox(layout)
    assert first.num_rows == 60

    aside = tmp_path / "aside"
    aside.mkdir()
    data_files = [p for p in Path(layout.inbox).glob("*.parquet")]
    assert data_files
    for p in data_files:
        shutil.move(str(p), aside / p.name)
    more = [landing_row(MB[i % 3], envelope(100 + i)) for i in range(30)] + rows[:10]
    land(layout, more, per_commit=10)
    sink = _run(spark, settings)
    for p in aside.iterdir():
        shutil.move(str(p), Path(layout.inbox) / p.name)

    inbox = _inbox(layout)
    assert inbox.num_rows == 90                        # the 10 resent were duplicates
    for cursors in _per_mailbox(inbox).values():
        assert sorted(cursors) == list(range(1, 31))
    seqs = sorted(inbox.column(C.SEQ).to_pylist())
    assert seqs == list(range(1, 91))
    assert sink.state is None                          # no dict of ids in the driver
    rejects = DeltaTable(str(layout.rejects)).to_pyarrow_table()
    assert rejects.column(C.REASON).to_pylist() == ["duplicate"] * 10


def test_a_new_checkpoint_starts_from_the_inbox(spark, settings, layout, tmp_path):
    """The checkpoint lost (or a stream started on another): the new one is seeded from the
    inbox once, so cursors continue and a resent envelope is still a duplicate."""
    rows = [landing_row(MB[i % 2], envelope(i)) for i in range(40)]
    land(layout, rows[:20], per_commit=10)
    _run(spark, settings)
    shutil.rmtree(settings.stream_checkpoint)
    land(layout, rows[20:] + rows[:5], per_commit=10)
    _run(spark, settings)
    inbox = _inbox(layout)
    assert inbox.num_rows == 40
    for cursors in _per_mailbox(inbox).values():
        assert sorted(cursors) == list(range(1, 21))
    assert sorted(inbox.column(C.SEQ).to_pylist()) == list(range(1, 41))


def test_landing_lag_is_read_from_the_tables_alone(spark, settings, layout, tmp_path):
    """`relay status` on a host without the stream's checkpoint or consumed file: the inbox's
    and rejects' logs say which landing versions the stream took, so the lag is right there."""
    from delta_tables.landing_lag import landing_lag, table_marks
    rows = [landing_row(MB[i % 2], envelope(i)) for i in range(30)]
    land(layout, rows[:20] + rows[:5], node="node-a", per_commit=5)    # 5 commits
    land(layout, rows[20:], node="node-b", per_commit=10)              # 1 commit
    _run(spark, settings)
    layout.landing_consumed_file.unlink(missing_ok=True)
    elsewhere = tmp_path / "no-checkpoint-here"
    marks = table_marks(layout)
    assert sorted(marks.values()) == [1, 5]        # node-b's one commit, node-a's five
    assert landing_lag(layout, elsewhere).versions == 0
    land(layout, [landing_row(MB[0], envelope(99))], node="node-b")
    lag = landing_lag(layout, elsewhere)
    assert lag.versions == 1 and lag.seconds >= 0


def _state_rows(spark, checkpoint: Path, var: str) -> int:
    """Rows of one state variable of the processor, through Spark's state data source."""
    return (spark.read.format("statestore").option("stateVarName", var)
            .load(str(checkpoint)).count())


def test_expired_ids_are_swept_from_the_state_store(spark, tmp_path):
    """The dedup index forgets an id once its envelope has expired: each mailbox's one timer
    sweeps them (no TTL index per id). A 2-second dedup window: after the first batch the
    state holds every accepted id; a batch past the window leaves only its own, and each
    swept mailbox keeps its cursor."""
    rules = StreamRules(max_ttl_us=2 * 10**6, cursor_start={}, max_envelope={}, overhead={})
    src, ckpt = tmp_path / "in", tmp_path / "ckpt"
    src.mkdir()

    def land_file(n: int, mailboxes: list[bytes], first: int) -> None:
        now = datetime.now(timezone.utc)
        rows = [landing_row(mailboxes[i % len(mailboxes)], envelope(first + i), received_at=now,
                            expires_at=now + timedelta(hours=1)) for i in range(n)]
        for r in rows:
            r[C.LANDING_TABLE], r[C.LANDING_VERSION] = "n-a/g000001", first
        pq.write_table(pa.Table.from_pylist(rows, schema=LANDING_SOURCE.arrow_schema()),
                       src / f"part-{first:03d}.parquet")

    def run() -> None:
        stream = spark.readStream.schema(LANDING_SOURCE.spark_schema()).parquet(str(src))
        query = (decided(stream, rules).writeStream.format("noop")
                 .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        query.awaitTermination(300)
        assert query.exception() is None

    land_file(30, MB[:3], first=0)
    run()
    assert [_state_rows(spark, ckpt, v) for v in ("seen", "cursor", "sweep_at")] == [30, 3, 3]
    time.sleep(3.5)          # past the window (2 s) and the sweep's step (1 s)
    land_file(1, MB[3:4], first=100)
    run()                    # the batch that takes the new row also fires the due sweeps
    assert [_state_rows(spark, ckpt, v) for v in ("seen", "cursor", "sweep_at")] == [1, 4, 1]
