"""Control planes on several hosts (decision 0009): two `HeyaControl`s / `PppControl`s /
`SyncControl`s, each with its own Delta handles and memory, over one set of real tables on disk
(as two hosts sharing a tables directory), and two real processes racing for one inbox token.
One-time tokens stay one-time, a token made on one host is honoured on the other, a restart
folds the same state, and row times stay unique per table (compaction's MERGE key)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from delta_tables.heya_control import HeyaControl, mint_inbox_tokens
from delta_tables.layout import Layout
from delta_tables.ppp_control import PppControl
from delta_tables.schema_heya import HEYA_MAILBOXES, HEYA_SEND_TOKENS
from delta_tables.schema_ppp import PPP_BACKUPS, PPP_DELIVERY_TOKENS
from delta_tables.schema_sync import SYNC_MEMBERS
from delta_tables.sync_control import SyncControl

ROOT = Path(__file__).resolve().parent.parent
END = 2220385707


def hosts(tmp_path) -> tuple[Layout, Layout]:
    """Two hosts: their own data directories, one tables directory."""
    tables = tmp_path / "tables"
    return Layout(tmp_path / "host-a", tables), Layout(tmp_path / "host-b", tables)


def table_path(tmp_path, tdef) -> Path:
    return hosts(tmp_path)[0].table_paths({tdef.name: tdef})[tdef.name]


async def two_heya(tmp_path, inbox_tokens: int) -> tuple[HeyaControl, HeyaControl, list]:
    """Host A and host B, loaded, after `inbox_tokens` inbox tokens were minted."""
    la, lb = hosts(tmp_path)
    tokens = mint_inbox_tokens(la, inbox_tokens, fsync=False)
    a, b = HeyaControl(la, fsync=False), HeyaControl(lb, fsync=False)
    await a.load()
    await b.load()
    return a, b, tokens


def assert_unique_increasing(path: Path) -> None:
    """Per commit, the rows it added come after every row before it: `at` is unique and
    increases in commit order (the fold's order, the MERGE key)."""
    seen: list[int] = []
    log = sorted((path / "_delta_log").glob("*.json"))
    for entry in log:
        for line in entry.read_text().splitlines():
            add = json.loads(line).get("add")
            if add is None:
                continue
            import pyarrow.parquet as pq
            ats = pc.cast(pq.read_table(path / add["path"]).column("at"),
                          pa.int64()).to_pylist()
            assert all(a > max(seen, default=0) for a in ats), "at not after earlier commits"
            seen.extend(ats)
    assert len(seen) == len(set(seen))


def test_two_hosts_race_for_one_inbox_token_one_wins(tmp_path):
    async def scenario():
        a, b, tokens = await two_heya(tmp_path, 12)
        la = a.layout
        won = []
        for i, tok in enumerate(tokens):
            ra, rb = await asyncio.gather(a.inco(b"A%031d" % i, tok), b.inco(b"B%031d" % i, tok))
            assert [ra, rb].count(True) == 1, (i, ra, rb)
            won.append("a" if ra else "b")
        # Stale for sure: A takes a token B has in memory as unused; B's commit loses, B
        # folds A's row and refuses.
        (late,) = mint_inbox_tokens(la, 1, fsync=False)
        await a.refresh()
        await b.refresh()
        assert await a.inco(b"A-late" + bytes(26), late)
        conflicts = b.conflicts
        assert not await b.inco(b"B-late" + bytes(26), late)
        assert b.conflicts == conflicts + 1
        # Every mailbox once, each token consumed once, on both hosts and after a restart.
        await a.refresh()
        await b.refresh()
        c = HeyaControl(la, fsync=False)
        await c.load()
        for h in (a, b, c):
            assert len(h.state.mailboxes) == 13
            assert h.state.used == set(tokens) | {late} and not h.state.minted
        return won

    won = asyncio.run(scenario())
    assert set(won) <= {"a", "b"}
    assert_unique_increasing(table_path(tmp_path, HEYA_MAILBOXES))


def test_send_token_made_on_one_host_is_honoured_and_extended_on_the_other(tmp_path):
    async def scenario():
        a, b, (inbox,) = await two_heya(tmp_path, 1)
        owner = bytes(range(32))
        assert await a.inco(owner, inbox)
        assert await b.find_mailbox(owner)                   # a miss looks in the tables
        tok = await a.auth(owner, 0, END)
        assert b.send_token(tok.token) is None               # not folded yet
        assert (await b.find_send_token(tok.token)).end == END
        # Both hosts extend it at once: both extensions count (read-modify-write, fenced).
        ea, eb = await asyncio.gather(a.extd(owner, tok.token, 10, 2**40),
                                      b.extd(owner, tok.token, 100, 2**40))
        assert sorted((ea, eb))[1] == END + 110
        # Revoked on B: A refuses it after a refresh (or its follow, within a second).
        assert await b.deau(owner, tok.token)
        await a.refresh()
        assert a.send_token(tok.token) is None
        assert not await a.deau(owner, tok.token)             # once only
        c = HeyaControl(b.layout, fsync=False)
        await c.load()
        assert c.state.mailboxes.keys() == a.state.mailboxes.keys() == {owner}
        assert c.state.tokens == a.state.tokens == b.state.tokens == {}

    asyncio.run(scenario())
    assert_unique_increasing(table_path(tmp_path, HEYA_SEND_TOKENS))


def test_a_host_follows_the_others_changes(tmp_path):
    async def scenario():
        a, b, (inbox,) = await two_heya(tmp_path, 1)
        b.start_following(0.05)
        owner = b"\x01" * 32
        assert await a.inco(owner, inbox)
        for _ in range(100):
            if b.is_mailbox(owner):
                break
            await asyncio.sleep(0.05)
        await b.stop_following()
        assert b.is_mailbox(owner)

    asyncio.run(scenario())


def test_ppp_caps_and_backup_versions_exact_across_hosts(tmp_path):
    async def scenario():
        la, lb = hosts(tmp_path)
        a = PppControl(la, fsync=False, max_tokens=3)
        b = PppControl(lb, fsync=False, max_tokens=3)
        await a.load()
        await b.load()
        recipient = b"R" * 32
        # Six registrations for one recipient, three per host, at once: the cap holds.
        got = await asyncio.gather(*(h.register_token(recipient, bytes([i]) * 16)
                                     for i, h in enumerate((a, b) * 3)))
        assert got.count(None) == 3 and got.count("too many delivery tokens") == 3
        mine = [bytes([i]) * 16 for i, g in enumerate(got) if g is None]
        # One delivery token raced by two recipients: one owner.
        got = await asyncio.gather(a.register_token(b"X" * 32, b"t" * 16),
                                   b.register_token(b"Y" * 32, b"t" * 16))
        assert sorted(got, key=str) == [None, "delivery token unavailable"]
        # Backups stored on both hosts at once: versions 1..4, none twice; the newest fetched
        # on either host.
        pk = b"P" * 32
        metas = await asyncio.gather(a.store_backup(pk, b"one"), b.store_backup(pk, b"two"),
                                     a.store_backup(pk, b"three"), b.store_backup(pk, b"four"))
        assert sorted(m.version for m in metas) == [1, 2, 3, 4]
        newest = max(metas, key=lambda m: m.version)
        fa, fb = await a.fetch_backup(pk), await b.fetch_backup(pk)
        assert fa == fb and fa[1] == newest
        # Registered on either, known on both: its recipient, its deregistration (once).
        for h in (a, b):
            assert all([await h.find_recipient(t) == recipient for t in mine])
        assert await b.deregister_token(recipient, mine[0])
        assert not await a.deregister_token(recipient, mine[0])
        c = PppControl(la, fsync=False)
        await c.load()
        await a.refresh()
        assert c.state.tokens == a.state.tokens == b.state.tokens
        assert c.state.backups == a.state.backups

    asyncio.run(scenario())
    for tdef in (PPP_DELIVERY_TOKENS, PPP_BACKUPS):
        assert_unique_increasing(table_path(tmp_path, tdef))


def test_sync_group_made_on_one_host_is_joined_on_the_other(tmp_path):
    async def scenario():
        la, lb = hosts(tmp_path)
        a, b = SyncControl(la, fsync=False), SyncControl(lb, fsync=False)
        await a.load()
        await b.load()
        group, d1, d2, d3 = b"G" * 32, b"1" * 32, b"2" * 32, b"3" * 32
        # Two hosts create one group at once, with two devices: one creates, one joins
        # (0k-sync's open groups) -- never two creations.
        got = await asyncio.gather(a.admit(group, d1, None, open_group=True),
                                   b.admit(group, d2, None, open_group=True))
        assert sorted(got) == ["created", "joined"]
        # d1 (admitted on A or B) admits d3 on B; revoked on A, refused on B.
        assert await b.admit(group, d3, d1) == "joined"
        assert await a.revoke(group, d3, d1)
        assert await b.admit(group, d3, d1) == "refused"
        # Ack progress written on each host, read on the other (order-independent fold).
        assert a.record_ack(group, d1, 5)
        assert b.record_ack(group, d2, 7)
        await a.flush_acks()
        await b.flush_acks()
        await a.refresh()
        await b.refresh()
        for h in (a, b):
            assert h.state.acked_cursor(group, d1) == 5 and h.state.acked_cursor(group, d2) == 7
        c = SyncControl(la, fsync=False)
        await c.load()
        assert c.state.members == a.state.members == b.state.members
        assert c.state.revoked == a.state.revoked
        for h in (a, b, c):
            await h.close()

    asyncio.run(scenario())
    assert_unique_increasing(table_path(tmp_path, SYNC_MEMBERS))


RACER = textwrap.dedent("""
    import asyncio, json, sys, time
    from pathlib import Path
    from delta_tables.heya_control import HeyaControl
    from delta_tables.layout import Layout

    data, tables, go, name = sys.argv[1:5]
    tokens = [bytes.fromhex(t) for t in sys.argv[5:]]

    async def main():
        c = HeyaControl(Layout(data, Path(tables)), fsync=True)
        await c.load()
        print("ready", flush=True)
        while not Path(go).exists():
            time.sleep(0.001)
        won = [await c.inco(name.encode().ljust(30, b"-") + bytes([i, 0]), t)
               for i, t in enumerate(tokens)]
        print(json.dumps({"won": won, "conflicts": c.conflicts}), flush=True)

    asyncio.run(main())
""")


def test_two_processes_race_for_the_same_inbox_tokens(tmp_path):
    """Two real processes (two hosts' ingress, as far as the control plane goes), released at
    once, INCO the same eight inbox tokens in the same order with different certificates:
    every token makes exactly one mailbox."""
    la, _ = hosts(tmp_path)
    tokens = mint_inbox_tokens(la, 8, fsync=False)
    go = tmp_path / "go"
    procs = [subprocess.Popen(
        [sys.executable, "-c", RACER, str(tmp_path / f"host-{n}"), str(tmp_path / "tables"),
         str(go), n, *(t.hex() for t in tokens)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for n in ("a", "b")]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        go.touch()
        results = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.wait(timeout=60)
    assert all(p.returncode == 0 for p in procs)
    for i in range(len(tokens)):
        assert [r["won"][i] for r in results].count(True) == 1, (i, results)
    print("two-process race:", results)

    async def reload():
        c = HeyaControl(la, fsync=False)
        await c.load()
        return c.state
    state = asyncio.run(reload())
    assert len(state.mailboxes) == 8 and state.used == set(tokens)
    assert_unique_increasing(table_path(tmp_path, HEYA_MAILBOXES))


def test_compaction_of_ack_rows_two_hosts_wrote_at_the_same_time(tmp_path):
    """Ack progress is appended by each host on its own (unfenced): two hosts' rows can share
    an `at`. Compaction still removes every superseded row and keeps what the fold rests on."""
    from jobs.compact_step import CompactionReport
    from jobs.compact_sync import compact_sync
    from delta_tables.schema_sync import SYNC_DEVICE_ACKS
    from delta_tables.sync_state import load_state, table_paths

    async def scenario():
        la, lb = hosts(tmp_path)
        clock = lambda: 1_800_000_000_000_000      # noqa: E731 - both hosts' clocks agree
        a, b = SyncControl(la, fsync=False, clock=clock), SyncControl(lb, fsync=False,
                                                                      clock=clock)
        await a.load()
        await b.load()
        group, d1, d2 = b"G" * 32, b"1" * 32, b"2" * 32
        assert await a.admit(group, d1, None, open_group=True) == "created"
        assert await b.admit(group, d2, None, open_group=True) == "joined"
        for cursor in range(1, 6):
            a.record_ack(group, d1, cursor)
            b.record_ack(group, d2, cursor * 10)
            await a.flush_acks()
            await b.flush_acks()
        for h in (a, b):
            await h.close()
        return la

    la = asyncio.run(scenario())
    path = table_paths(la)[SYNC_DEVICE_ACKS.name]
    ats = pc.cast(DeltaTable(str(path)).to_pyarrow_table().column("at"), pa.int64()).to_pylist()
    assert len(ats) == 10 and len(set(ats)) < len(ats)          # the hosts' rows collide
    before = load_state(table_paths(la))
    report = CompactionReport()
    compact_sync(la, report, 1 << 20, 0)
    after = DeltaTable(str(path)).to_pyarrow_table()
    # Every row of an `at` nothing needs is gone; a row sharing a needed row's `at` waits
    # for a later run (kept, never a needed one deleted).
    needed = before.needed_at()[SYNC_DEVICE_ACKS.name]
    left = pc.cast(after.column("at"), pa.int64()).to_pylist()
    assert set(left) == needed and not report.skipped
    assert after.num_rows < 4 and report.sync_control_removed >= 7
    state = load_state(table_paths(la))
    assert state.acked == before.acked == {(b"G" * 32, b"1" * 32): 5, (b"G" * 32, b"2" * 32): 50}


def test_heya_auth_and_iosa_racing_a_dall_on_another_host(tmp_path):
    """An AUTH (or IOSA) and the same mailbox's DALL on two hosts: either the AUTH committed
    first and the DALL revokes its token, or the AUTH sees the DALL under way and is refused;
    never a send token of a deregistered mailbox."""
    from delta_tables.schema_heya import OP_DALL_MARK

    async def scenario():
        a, b, inbox = await two_heya(tmp_path, 24)
        la = a.layout
        o1, o2, o3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
        for owner, tok in zip((o1, o2, o3), inbox):
            assert await a.inco(owner, tok)
        await b.refresh()
        # 1. AUTH on A first; B's DALL, stale, loses its commit, folds the token, revokes it.
        t = await a.auth(o1, 0, END)
        assert await b.dall(o1) == [t.token]
        await a.refresh()
        assert not a.is_mailbox(o1) and a.send_token(t.token) is None
        # 2. DALL on B first; A's AUTH, stale, loses its commit and is refused.
        assert await b.dall(o2) == []
        assert await a.auth(o2, 0, END) is None
        # 3. A DALL under way (its mark written, the mailbox not yet: a crash there): AUTH and
        #    IOSA refused on the other host; the DALL repeated completes; INCO again reopens.
        async def mark():
            at = b.next_at(b.state)
            await b.write(HEYA_SEND_TOKENS.name, [b._token_row(OP_DALL_MARK, b"", o3, 0, 0, at)])
            b.state.send_token_row(OP_DALL_MARK, b"", o3, 0, 0, at)
        await b.change(mark)
        assert await a.auth(o3, 0, END) is None
        assert await a.iosa(o3, "device-1") is False
        assert a.is_mailbox(o3)
        assert await a.dall(o3) == []
        assert await b.inco(o3, inbox[3])
        assert (await a.auth(o3, 0, END)) is not None
        # 4. At once, many times: no token outlives its mailbox.
        owners = [bytes([0x40 + i]) * 32 for i in range(10)]
        for owner, tok in zip(owners, inbox[4:]):
            assert await a.inco(owner, tok)
        await b.refresh()
        for owner in owners:
            await asyncio.gather(a.auth(owner, 0, END), b.dall(owner), a.iosa(owner, "d"))
        c = HeyaControl(la, fsync=False)
        await c.load()
        await a.refresh()
        await b.refresh()
        for h in (a, b, c):
            assert all(tok.owner in h.state.mailboxes for tok in h.state.tokens.values())
            assert set(h.state.push) <= set(h.state.mailboxes)
            assert not any(h.is_mailbox(o) for o in owners)

    asyncio.run(scenario())


def test_two_hosts_on_the_test_store(settings, tmp_path):
    """The race and a token across hosts on the tables the test run uses: a local directory,
    or an S3 server with RELAY_TEST_TABLES=s3 (a conditional PUT per commit, a HEAD per
    follow)."""
    tables = settings.tables_dir or str(tmp_path / "tables")

    def host(name: str) -> Layout:
        return Layout.at(tmp_path / name, tables, settings.object_store.endpoint,
                         settings.object_store.region)

    async def scenario():
        a, b = HeyaControl(host("a"), fsync=True), HeyaControl(host("b"), fsync=True)
        tokens = mint_inbox_tokens(host("a"), 4, fsync=True)
        await a.load()
        await b.load()
        for i, tok in enumerate(tokens):
            ra, rb = await asyncio.gather(a.inco(b"A%031d" % i, tok), b.inco(b"B%031d" % i, tok))
            assert [ra, rb].count(True) == 1
        owner = next(iter(a.state.mailboxes.keys() | b.state.mailboxes.keys()))
        host_of = a if owner in a.state.mailboxes else b
        other = b if host_of is a else a
        tok = await host_of.auth(owner, 0, END)
        assert (await other.find_send_token(tok.token)).end == END
        assert await other.deau(owner, tok.token)
        assert not await host_of.deau(owner, tok.token)
        c = HeyaControl(host("c"), fsync=False)
        await c.load()
        await a.refresh()
        await b.refresh()
        assert c.state.mailboxes == a.state.mailboxes == b.state.mailboxes
        assert len(c.state.mailboxes) == 4 and c.state.tokens == {}

    asyncio.run(scenario())


def test_handles_opened_afresh_keep_memory_and_tables_together(tmp_path, monkeypatch):
    """A host reopens a table's handle after `REOPEN_EVERY` commits through it (a long-lived
    delta-rs handle slows); the rows the fresh handle shows are folded with it, so both hosts
    still agree on every token after changes in turn, stale and fresh."""
    from delta_tables import control
    monkeypatch.setattr(control, "REOPEN_EVERY", 5)

    async def scenario():
        a, b, (inbox,) = await two_heya(tmp_path, 1)
        owner = b"o" * 32
        assert await a.inco(owner, inbox)
        minted = []
        for i in range(23):
            h = a if i % 3 else b
            if i % 4 == 0:
                await h.refresh()
            minted.append((await h.auth(owner, 0, END)).token)
        await a.refresh()
        await b.refresh()
        assert set(a.state.tokens) == set(b.state.tokens) == set(minted)
        assert a.conflicts and b.conflicts

    asyncio.run(scenario())
    assert_unique_increasing(table_path(tmp_path, HEYA_SEND_TOKENS))
