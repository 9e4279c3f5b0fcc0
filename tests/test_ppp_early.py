"""The PPP view's early events (issue 20) on their own: FETCH pages that run into them and
continue among them while their inbox rows arrive, the room they may take, and expiry."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from egress.pending import PendingEnvelope
from egress.ppp_inbox import EARLY_BASE, PppInbox
from engine.ppp.giftwrap import GiftWrap

from ppp_wire import giftwrap

BOB = b"\x0b" * 32


class Recorder:
    def __init__(self):
        self.counts: list[int] = []

    def notify(self, count: int) -> None:
        self.counts.append(count)


def view(tmp_path, **kw) -> tuple[PppInbox, Recorder]:
    inbox = PppInbox(tmp_path / "inbox", tmp_path / "acks", notify_window=0, **kw)
    s = Recorder()
    inbox.register(BOB, s)
    return inbox, s


def land(inbox: PppInbox, n: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        env, eid = giftwrap(BOB, ciphertext=b"c" * 100)
        gw = GiftWrap.decode(env)
        assert inbox.land_early(BOB, eid, eid, env, gw.created_at, float(gw.expires_at))
        out.append((env, eid))
    return out


def rows(events, first_cursor: int, first_seq: int) -> list[PendingEnvelope]:
    exp = datetime.now(timezone.utc) + timedelta(hours=1)
    return [PendingEnvelope(first_seq + i, first_cursor + i, eid, env, exp)
            for i, (env, eid) in enumerate(events)]


def page(inbox: PppInbox, after, limit=3):
    evts, nxt = inbox.fetch(BOB, 0, after, limit, time.time())
    return [e.event_id for e in evts], nxt


def test_pages_continue_among_early_events_while_their_rows_arrive(tmp_path):
    inbox, s = view(tmp_path)
    old = [giftwrap(BOB, ciphertext=b"o" * 100) for _ in range(2)]
    inbox.add("ppp", BOB, rows(old, 1, 100))          # two events from the stream
    early = land(inbox, 5)
    assert s.counts == [2, 1, 1, 1, 1, 1]               # one NOTIFY per event, window 0
    ids, nxt = page(inbox, None)
    assert ids == [old[0][1], old[1][1], early[0][1]] and nxt == EARLY_BASE + 1
    # the first three early events' rows arrive between two pages: nothing is skipped or
    # repeated, and their rows are not NOTIFY'd again
    inbox.add("ppp", BOB, rows(early[:3], 3, 200))
    assert s.counts == [2, 1, 1, 1, 1, 1]
    ids, nxt = page(inbox, nxt)
    assert ids == [e[1] for e in early[1:4]] and nxt == EARLY_BASE + 4
    ids, nxt = page(inbox, nxt)
    assert ids == [early[4][1]] and nxt is None
    # a fresh FETCH: the inbox's events in cursor order, then what is still early
    assert page(inbox, None, limit=10) == ([e[1] for e in old + early], None)


def test_early_events_take_bounded_room_and_only_for_a_connected_recipient(tmp_path):
    inbox, _ = view(tmp_path, early_max_bytes=500)
    env, eid = giftwrap(b"\x0c" * 32)
    gw = GiftWrap.decode(env)
    assert not inbox.land_early(b"\x0c" * 32, eid, eid, env, gw.created_at, gw.expires_at)
    land(inbox, 2)                                      # ~210 bytes each
    env, eid = giftwrap(BOB, ciphertext=b"c" * 100)
    gw = GiftWrap.decode(env)
    assert not inbox.land_early(BOB, eid, eid, env, gw.created_at, gw.expires_at)  # full
    assert 400 < inbox.early_bytes <= 500


def test_an_acked_early_event_is_handed_over_when_its_row_arrives(tmp_path):
    inbox, _ = view(tmp_path)
    handed: list = []
    inbox.on_deferred_acks = lambda mailbox, evs: handed.append((mailbox, evs))
    (e1, e2) = land(inbox, 2)
    taken, early = inbox.take(BOB, [e1[1], b"\x00" * 32])
    assert taken == [] and [e.event_id for e in early] == [e1[1]]
    assert page(inbox, None) == ([e2[1]], None)
    inbox.add("ppp", BOB, rows([e1, e2], 1, 500))
    ((mailbox, evs),) = handed
    assert mailbox == BOB and [(e.event_id, e.seq, e.cursor) for e in evs] == [(e1[1], 500, 1)]
    assert page(inbox, None) == ([e2[1]], None) and inbox.early_bytes == 0


def test_early_events_expire_and_stale_ones_are_let_go(tmp_path, monkeypatch):
    inbox, _ = view(tmp_path)
    land(inbox, 2)
    assert inbox.early_bytes > 0
    import egress.ppp_inbox as mod
    monkeypatch.setattr(mod, "EARLY_MAX_AGE_SECONDS", -1.0)   # the stream never caught up
    inbox.sweep(time.time())
    assert inbox.early_bytes == 0 and page(inbox, None) == ([], None)
