"""The load generator's synthetic day is what the notebooks rely on: true to the stream's rules
(gap-free cursors, dedup, expiry), with realistic timings, acks only for what was delivered,
and the day's landing sealed so a later stream does not re-read it. `relay status` and the
notebooks' private views are checked on the same day."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from delta_tables.landing_lag import landing_lag
from delta_tables.layout import Layout
from delta_tables.schema import ACKS, INBOX, REJECTS, C
from jobs.loadgen import generate_day, heya_tokens
from jobs.table_views import private_view, read_table
from relay import status


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    from runtime import config
    settings = config.load(None, env={}, data_dir=str(tmp_path_factory.mktemp("lg") / "data"))
    report = generate_day(settings, hours=6, scale=0.1, seed=3)
    return settings, report


def table(settings, tdef) -> pa.Table:
    return DeltaTable(str(Layout.of(settings).table(tdef))).to_pyarrow_table()


def test_day_follows_the_streams_rules(day):
    settings, report = day
    inbox = table(settings, INBOX)
    assert inbox.num_rows == report.inbox_rows > 0
    assert set(inbox.column(C.PROTOCOL).to_pylist()) == {"trueseal", "heya", "ppp",
                                                         "ppp_room"}
    ids = inbox.column(C.EVENT_ID).to_pylist()
    assert len(ids) == len(set(ids))
    per: dict = {}
    for p, m, c in zip(*(inbox.column(x).to_pylist() for x in (C.PROTOCOL, C.MAILBOX, C.CURSOR))):
        per.setdefault((p, m), []).append(c)
    for (p, _), cursors in per.items():
        first = 0 if p == "heya" else 1          # Heya sequence numbers start at 0
        assert sorted(cursors) == list(range(first, first + len(cursors)))
    # a few mailboxes get most of the traffic
    sizes = sorted((len(c) for c in per.values()), reverse=True)
    assert sum(sizes[:max(1, len(sizes) // 10)]) > 0.3 * sum(sizes)
    reasons = table(settings, REJECTS).column(C.REASON).to_pylist()
    assert set(reasons) == {"duplicate", "expired"} and reasons.count("duplicate") > 5
    # Heya retries are new messages (their event id is per SEND), never duplicates
    rej = table(settings, REJECTS)
    assert "heya" not in rej.filter(pc.equal(rej.column(C.REASON), "duplicate")) \
        .column(C.PROTOCOL).to_pylist()


def test_day_has_rooms_made_through_the_control_plane(day):
    """Rooms exist in the PPP control tables; their messages land within each room's life,
    in rooms that exist, numbered from 1, and are never acked."""
    from delta_tables.ppp_state import load_state, table_paths
    settings, report = day
    rooms = load_state(table_paths(Layout.of(settings))).rooms.rooms
    assert len(rooms) == report.rooms >= 8 and report.room_messages > 0
    inbox = table(settings, INBOX)
    msgs = inbox.filter(pc.equal(inbox.column(C.PROTOCOL), "ppp_room"))
    assert 0 < msgs.num_rows <= report.room_messages
    for m, recv in zip(msgs.column(C.MAILBOX).to_pylist(),
                       msgs.column(C.RECEIVED_AT).to_pylist()):
        room = rooms[m]
        assert room.created_at - 1 <= recv.timestamp() <= room.expires_at + 1
    acks = table(settings, ACKS)
    assert "ppp_room" not in set(acks.column(C.PROTOCOL).to_pylist())


def test_day_timings_are_realistic(day):
    settings, report = day
    inbox = table(settings, INBOX)
    recv = pc.cast(inbox.column(C.RECEIVED_AT), pa.int64()).to_numpy()
    commit = pc.cast(inbox.column(C.COMMITTED_AT), pa.int64()).to_numpy()
    lat = (commit - recv) / 1e6
    assert lat.min() > 0 and lat.max() < 5 and 0.1 < float(sorted(lat)[len(lat) // 2]) < 2
    assert recv.min() >= report.start.timestamp() * 1e6
    assert recv.max() < report.end.timestamp() * 1e6
    acks = table(settings, ACKS)
    assert 0.5 * inbox.num_rows < acks.num_rows == report.acks < inbox.num_rows
    by_seq = dict(zip(inbox.column(C.SEQ).to_pylist(), inbox.column(C.COMMITTED_AT).to_pylist()))
    exp = dict(zip(inbox.column(C.SEQ).to_pylist(), inbox.column(C.EXPIRES_AT).to_pylist()))
    for seq, acked in zip(acks.column(C.SEQ).to_pylist(), acks.column(C.ACKED_AT).to_pylist()):
        assert by_seq[seq] < acked <= report.end and acked < exp[seq]
    assert len(set(acks.column(C.SEQ).to_pylist())) == acks.num_rows


def test_day_is_sealed_for_the_next_stream(day):
    settings, report = day
    layout = Layout.of(settings)
    assert report.landing_dropped == 1
    tables = layout.landing_tables()
    assert list(tables) == [f"{settings.ingress.node_id}/g000002"]   # empty, unsealed
    assert landing_lag(layout).versions == 0
    # every Heya mailbox of the day is a live send token: compaction keeps its rows
    inbox = table(settings, INBOX)
    heya = set(inbox.filter(pc.equal(inbox.column(C.PROTOCOL), "heya"))
               .column(C.MAILBOX).to_pylist())
    assert heya and heya <= set(heya_tokens(layout))


def test_status_counts_match_the_tables(day):
    settings, report = day
    now = datetime.now(timezone.utc)
    st = status.collect(settings, now)
    inbox, acks = table(settings, INBOX), table(settings, ACKS)
    acked = set(acks.column(C.SEQ).to_pylist())
    pending: dict[str, int] = {}
    live = 0
    for p, seq, env, exp in zip(*(inbox.column(x).to_pylist()
                                  for x in (C.PROTOCOL, C.SEQ, C.ENVELOPE, C.EXPIRES_AT))):
        if env is not None and exp > now and seq not in acked:
            live += len(env)
            if p != "ppp_room":
                pending[p] = pending.get(p, 0) + 1
    assert {p: s.pending for p, s in st.protocols.items() if s.pending} == pending
    # storage: live ciphertext is the pending envelopes' bytes (room messages included)
    assert st.storage.live_bytes == live > 0
    assert st.storage.table_bytes["inbox"] > 0 and "landing" in st.storage.table_bytes
    assert sum(st.storage.table_bytes.values()) <= st.tables_bytes
    acked_carrying = [r[C.SEQ] for r in inbox.select([C.SEQ, C.ENVELOPE]).to_pylist()
                      if r[C.ENVELOPE] is not None and r[C.SEQ] in acked]
    # the day was not compacted: its acked envelopes still carry their bytes, since the day
    assert acked_carrying
    assert 0 < st.storage.oldest_delivered_s < (now - report.start).total_seconds() + 1
    # room messages are never acked: no pending count or age (they stay until expiry)
    assert st.protocols["ppp_room"].pending is None
    assert st.protocols["ppp_room"].oldest_pending_s is None
    assert sum(s.inbox_rows for s in st.protocols.values()) == inbox.num_rows
    assert sum(s.acks for s in st.protocols.values()) == acks.num_rows
    assert sum(sum(s.rejects.values()) for s in st.protocols.values()) == sum(
        report.rejected.values())
    oldest = st.protocols["trueseal"].oldest_pending_s
    assert oldest is not None and oldest < (now - report.start).total_seconds() + 1
    text = status.format_status(st)
    assert "pending" in text and "landing lag" in text and "live ciphertext" in text
    for mailbox in set(inbox.column(C.MAILBOX).to_pylist()):
        assert mailbox.hex() not in text and mailbox.hex() not in status.to_json(st)


def test_private_views_hold_no_keys_or_ciphertext(day):
    settings, _ = day
    layout = Layout.of(settings)
    for tdef in (INBOX, ACKS, REJECTS):
        view = read_table(layout, tdef)
        assert not [f.name for f in view.schema if pa.types.is_binary(f.type)], tdef.name
        assert "mailbox_hash" in view.column_names
    inbox = table(settings, INBOX)
    view = private_view(inbox)
    assert view.column("envelope_size").to_pylist() == \
        pc.binary_length(inbox.column(C.ENVELOPE)).to_pylist()
    assert all(len(h) == 12 for h in view.column("mailbox_hash").to_pylist())
    raw = {m.hex()[:12] for m in inbox.column(C.MAILBOX).to_pylist()}
    assert not raw & set(view.column("mailbox_hash").to_pylist())


def test_retain_lets_retention_pass_and_reports_the_storage_ratio(tmp_path):
    """`relay loadgen --retain`: once compaction's retention passed, the tables are no bigger
    than compaction found them, and what they hold is mostly what is still to deliver."""
    from runtime import config
    settings = config.load(None, env={}, data_dir=str(tmp_path / "data"))
    settings.compaction.vacuum_retention_seconds = 0
    report = generate_day(settings, hours=2, scale=0.05, seed=5, retain=True)
    assert report.live_bytes > 0
    assert report.tables_bytes_after <= report.tables_bytes_before
    assert sum(report.table_bytes.values()) == report.tables_bytes_after
    st = status.collect(settings)
    assert st.storage.oldest_delivered_s is None, "retention passed: no delivered byte left"
    print(report.format())
