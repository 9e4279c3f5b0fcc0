"""Readers that filter inbox / acks by protocol or mailbox keep working once compaction has
rewritten the files. delta-rs writes string_view / binary_view columns when it rewrites
(OPTIMIZE, MERGE), appends write string / binary, and a pyarrow dataset filter comparing the
two failed ("no kernel matching input types (string, string_view)"): Heya ingress could not
start, and egress could not page in an overflowing mailbox, after the first compaction.
Found with a synthetic day from the load generator; `delta_tables.layout.equals` is the fix."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import ACKS, INBOX, C
from egress.inbox_tail import InboxTail
from egress.pending import MailboxHub
from egress.heya_inbox import HeyaInbox
from jobs.compact import run_compaction
from jobs.loadgen import generate_day


class _Owners:
    def owner_of(self, token):
        return b"o" * 32

    def trimmed(self, token):
        return -1


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    from runtime import config
    settings = config.load(None, env={}, data_dir=str(tmp_path_factory.mktemp("rc") / "data"))
    generate_day(settings, hours=2, scale=0.05, seed=5)
    run_compaction(settings)
    layout = Layout.of(settings)
    views = {str(pq.read_schema(u).field(C.PROTOCOL).type)
             for u in DeltaTable(str(layout.inbox)).file_uris()}
    assert "string_view" in views       # the situation this test is about
    return layout


def _pending(layout: Layout, protocol: str) -> tuple[bytes, int]:
    t = DeltaTable(str(layout.inbox)).to_pyarrow_table(columns=[C.PROTOCOL, C.MAILBOX, C.CURSOR,
                                                                C.ENVELOPE])
    t = t.filter(pc.and_(pc.equal(t.column(C.PROTOCOL), protocol),
                         pc.is_valid(t.column(C.ENVELOPE))))
    return t.column(C.MAILBOX)[0].as_py(), t.column(C.CURSOR)[0].as_py()


def test_egress_pages_in_a_mailbox_after_compaction(compacted):
    tail = InboxTail(compacted.inbox, compacted.acks, MailboxHub(ack_sink=None))
    mailbox, cursor = _pending(compacted, "trueseal")
    rows = tail._load("trueseal", mailbox, cursor - 1, 10)
    assert rows and rows[0].cursor == cursor
    acked = DeltaTable(str(compacted.table(ACKS))).to_pyarrow_table(columns=[C.MAILBOX])
    assert len(tail._acked_seqs(acked.column(C.MAILBOX)[0].as_py())) >= 1


def test_heya_inbox_bootstraps_and_reads_after_compaction(compacted):
    inbox = HeyaInbox(compacted.table(INBOX), _Owners())
    _, nxt = inbox._bootstrap_read()
    token, seq = _pending(compacted, "heya")
    assert nxt[token] > seq
    assert inbox._read_body(token, seq) is not None
