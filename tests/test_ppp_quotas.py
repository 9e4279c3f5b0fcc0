"""PPP's hourly quotas exact across hosts (decision 0010): STORE_BACKUP's 5 an hour (spec 004
appendix C.3) spent over two hosts, on real Delta tables on disk.

Two `PppControl`s over one tables directory (two hosts' control planes) and two real
`relay ingress --protocol ppp` processes with PPP clients on the wire (`ppp_wire.py`,
`hosts_harness.py`): the sixth hit is refused whichever host it reaches, two hosts racing for
the last hit let exactly one through, a restart keeps the count, and compaction drops the
hits past the window and keeps those inside it. The rows never hold the pubkey.
"""

from __future__ import annotations

import asyncio
import time

from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.ppp_control import PppControl
from delta_tables.ppp_state import load_state, table_paths
from delta_tables.schema_ppp import PPP_BUDGET_HITS, Q
from jobs.compact_ppp import compact_ppp
from jobs.compact_step import CompactionReport

from hosts_harness import Host
from ppp_wire import Ws

HOUR_US = 3600 * 1_000_000


class WallClock:
    """Unix µs for the control planes' row times: now, or moved back by the test."""
    def __init__(self):
        self.back = 0

    def __call__(self) -> int:
        return int(time.time() * 1_000_000) - self.back


def two_hosts(tmp_path, clock=None) -> tuple[PppControl, PppControl]:
    tables = tmp_path / "tables"
    kw = {} if clock is None else {"clock": clock}
    return (PppControl(Layout(tmp_path / "host-a", tables), fsync=False, **kw),
            PppControl(Layout(tmp_path / "host-b", tables), fsync=False, **kw))


def hit_rows(tmp_path) -> dict:
    path = Layout(tmp_path / "host-a", tmp_path / "tables").table_paths(
        {PPP_BUDGET_HITS.name: PPP_BUDGET_HITS})[PPP_BUDGET_HITS.name]
    return DeltaTable(str(path)).to_pyarrow_table().to_pydict()


def test_store_backup_quota_spread_over_two_hosts_and_raced(tmp_path):
    async def scenario():
        a, b = two_hosts(tmp_path)
        await a.load()
        await b.load()
        pk = bytes(SigningKey.generate().verify_key)
        # Five hits over both hosts, each host's memory behind the other's commits.
        assert [await h.spend(pk, "STORE_BACKUP") for h in (a, b, a, b, a)] == [True] * 5
        # The sixth, whichever host it reaches: B has not folded A's fifth hit, so B's commit
        # loses, B folds it and refuses; A refuses from memory.
        assert await b.spend(pk, "STORE_BACKUP") is False
        assert await a.spend(pk, "STORE_BACKUP") is False
        # Other quotas and other callers are counted apart.
        assert await b.spend(pk, "FETCH_BACKUP") is True
        other = bytes(SigningKey.generate().verify_key)
        assert await a.spend(other, "STORE_BACKUP") is True
        # Two hosts racing for the last hit, round after round: exactly one wins.
        for _ in range(4):
            caller = bytes(SigningKey.generate().verify_key)
            for h in (a, b, b, a):
                assert await h.spend(caller, "STORE_BACKUP")
            got = await asyncio.gather(a.spend(caller, "STORE_BACKUP"),
                                       b.spend(caller, "STORE_BACKUP"))
            assert sorted(got) == [False, True], got
            assert not any(await asyncio.gather(a.spend(caller, "STORE_BACKUP"),
                                                b.spend(caller, "STORE_BACKUP")))
        # A restart (a fresh control plane on A's data directory) keeps the count.
        c = PppControl(a.layout, fsync=False)
        await c.load()
        assert await c.spend(pk, "STORE_BACKUP") is False
        assert [await c.spend(other, "STORE_BACKUP") for _ in range(5)] == [True] * 4 + [False]
        return pk, other

    pk, other = asyncio.run(scenario())
    rows = hit_rows(tmp_path)
    assert len(rows[Q.AT]) == 5 + 1 + 5 + 4 * 5
    # The pubkey is in no row; one pubkey is one hash on every host.
    assert all(pk not in h and other not in h for h in rows[Q.PUBKEY_HASH])
    assert len(set(rows[Q.PUBKEY_HASH])) == 2 + 4
    assert len(set(rows[Q.AT])) == len(rows[Q.AT])           # compaction's MERGE key


def test_the_window_slides_and_compaction_keeps_only_the_hits_inside_it(tmp_path):
    async def scenario():
        clock = WallClock()
        a, b = two_hosts(tmp_path, clock)
        await a.load()
        await b.load()
        pk = bytes(SigningKey.generate().verify_key)
        clock.back = HOUR_US + 120 * 1_000_000            # two minutes past an hour ago
        assert [await h.spend(pk, "STORE_BACKUP") for h in (a, b) * 3] == [True] * 5 + [False]
        clock.back = 0                                    # those five left the window
        assert [await h.spend(pk, "STORE_BACKUP") for h in (b, a, b)] == [True] * 3
        return a, pk

    a, pk = asyncio.run(scenario())
    report = CompactionReport()
    detail = compact_ppp(a.layout, report, 1 << 20, 0)
    assert report.ppp_control_removed == 5, detail
    rows = hit_rows(tmp_path)
    assert len(rows[Q.AT]) == 3
    assert min(int(t.timestamp() * 1_000_000) for t in rows[Q.AT]) > time.time() * 1e6 - HOUR_US
    # The fold after compaction counts what the fold before it counted inside the window.
    st = load_state(table_paths(a.layout))
    assert sum(len(v) for v in st.budget.hits.values()) == 3

    async def after():       # restarted after compaction: three spent, two left
        c = PppControl(a.layout, fsync=False)
        await c.load()
        return [await c.spend(pk, "STORE_BACKUP") for _ in range(3)]
    assert asyncio.run(after()) == [True, True, False]


def test_store_backup_quota_over_two_ppp_processes_on_the_wire(tmp_path):
    asyncio.run(_wire(tmp_path))


async def _wire(tmp_path) -> None:
    a, b = Host(tmp_path, "a", "ppp"), Host(tmp_path, "b", "ppp")
    await asyncio.gather(a.start(), b.start())
    try:
        sk = SigningKey.generate()
        on_a, on_b = await Ws.login(a.port(), sk), await Ws.login(b.port(), sk)
        versions = []
        for c in (on_a, on_b, on_a, on_b, on_a):
            r = await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"v"})
            assert r["cmd"] == "BACKUP_STORED", r
            versions.append(r["version"])
        assert versions == [1, 2, 3, 4, 5]
        for c in (on_b, on_a):                         # the sixth, on either host
            r = await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"v"})
            assert r["cmd"] == "BACKUP_FAIL" and r["reason"].startswith("rate limited ("), r
        # The last hit raced on both hosts: one stored, one refused as rate limited.
        racer = SigningKey.generate()
        ra, rb = await Ws.login(a.port(), racer), await Ws.login(b.port(), racer)
        for c in (ra, rb, rb, ra):
            assert (await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"r"}))[
                "cmd"] == "BACKUP_STORED"
        got = await asyncio.gather(ra.call({"cmd": "STORE_BACKUP", "ciphertext": b"a"}),
                                   rb.call({"cmd": "STORE_BACKUP", "ciphertext": b"b"}))
        assert sorted(r["cmd"] for r in got) == ["BACKUP_FAIL", "BACKUP_STORED"], got
        assert [r for r in got if r["cmd"] == "BACKUP_FAIL"][0]["reason"].startswith(
            "rate limited")
        for c in (on_a, on_b, ra, rb):
            await c.close()
        # A restarted host keeps the count: still refused there.
        assert await a.stop() == 0
        await a.start()
        on_a = await Ws.login(a.port(), sk)
        r = await on_a.call({"cmd": "STORE_BACKUP", "ciphertext": b"v"})
        assert r["cmd"] == "BACKUP_FAIL" and r["reason"].startswith("rate limited"), r
        assert (await on_a.call({"cmd": "FETCH_BACKUP"}))["version"] == 5
        await on_a.close()
    finally:
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
