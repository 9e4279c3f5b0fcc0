"""The egress hub: claims, one flush winner, scoped acks, bounded memory with paging."""

import asyncio

import pytest

from egress.pending import MailboxHub, PendingEnvelope


def env(seq, cursor=None):
    return PendingEnvelope(seq=seq, cursor=cursor or seq, event_id=bytes([seq % 256]) * 32,
                           envelope=b"x" * 10)


class Acks:
    def __init__(self):
        self.rows = []

    async def __call__(self, protocol, mailbox, e, device):
        await asyncio.sleep(0)
        self.rows.append((protocol, mailbox, e.seq))


A, B = b"a" * 32, b"b" * 32


async def _next(s, timeout=0.2):
    return await asyncio.wait_for(s.next(), timeout)


def test_delivers_in_order_and_acks_only_own_mailbox():
    async def main():
        acks = Acks()
        hub = MailboxHub(acks)
        hub.add("trueseal", A, [env(1), env(2)])
        hub.add("trueseal", B, [env(3, 1)])
        sa = hub.open_session("trueseal", A)
        assert [e.seq for e in await _next(sa)] == [1, 2]
        assert await sa.ack(3) is False          # B's envelope: not A's to ack
        assert await sa.ack(1) is True
        assert await sa.ack(1) is False          # second ack changes nothing
        assert acks.rows == [("trueseal", A, 1)]
        assert hub.pending_count() == 2          # A:2 and B:3 remain
    asyncio.run(main())


def test_never_twice_in_one_session_redelivered_on_next():
    async def main():
        hub = MailboxHub(Acks())
        hub.add("trueseal", A, [env(1)])
        s1 = hub.open_session("trueseal", A)
        assert [e.seq for e in await _next(s1)] == [1]
        with pytest.raises(asyncio.TimeoutError):
            await _next(s1, 0.05)
        s1.close()
        s2 = hub.open_session("trueseal", A)
        assert [e.seq for e in await _next(s2)] == [1]
    asyncio.run(main())


def test_one_session_wins_the_flush_and_order_holds_across_overlap():
    async def main():
        hub = MailboxHub(Acks())
        hub.add("trueseal", A, [env(1), env(2)])
        old = hub.open_session("trueseal", A)
        assert [e.seq for e in await _next(old)] == [1, 2]
        new = hub.open_session("trueseal", A)
        assert old.superseded.is_set() and old.holds_claims
        hub.add("trueseal", A, [env(3)])
        with pytest.raises(asyncio.TimeoutError):   # 1 and 2 are old's: not flushed twice,
            await _next(new, 0.05)                  # and 3 must not overtake them
        assert await old.ack(1)
        with pytest.raises(asyncio.TimeoutError):
            await _next(new, 0.05)
        old.close()                                 # dies without acking 2
        assert [e.seq for e in await _next(new)] == [2, 3]
    asyncio.run(main())


def test_older_session_acking_lets_the_newer_continue_in_order():
    async def main():
        hub = MailboxHub(Acks())
        hub.add("trueseal", A, [env(1)])
        old = hub.open_session("trueseal", A)
        await _next(old)
        new = hub.open_session("trueseal", A)
        hub.add("trueseal", A, [env(2)])
        assert await old.ack(1)
        assert [e.seq for e in await _next(new)] == [2]
        assert not old.holds_claims
    asyncio.run(main())


def test_bounded_memory_pages_in_from_loader():
    async def main():
        stored = [env(i) for i in range(1, 11)]
        calls = []

        async def loader(protocol, mailbox, after, limit):
            calls.append((after, limit))
            return [e for e in stored if e.cursor > after][:limit]

        hub = MailboxHub(Acks(), max_pending=4, loader=loader)
        hub.add("trueseal", A, stored)
        assert hub.pending_count() == 4
        s = hub.open_session("trueseal", A)
        seen = []
        while len(seen) < 10:
            batch = await _next(s)
            for e in batch:
                seen.append(e.seq)
                assert await s.ack(e.seq)
            assert hub.pending_count() <= 4
        assert seen == list(range(1, 11))
        assert calls, "overflow must be paged in from the table"
    asyncio.run(main())


def test_expired_envelopes_are_not_delivered():
    from datetime import datetime, timedelta, timezone
    async def main():
        now = datetime.now(timezone.utc)
        hub = MailboxHub(Acks())
        hub.add("trueseal", A, [PendingEnvelope(1, 1, b"e" * 32, b"x", now - timedelta(seconds=1)),
                                PendingEnvelope(2, 2, b"f" * 32, b"y", now + timedelta(hours=1))])
        s = hub.open_session("trueseal", A)
        assert [e.seq for e in await _next(s)] == [2]
    asyncio.run(main())
