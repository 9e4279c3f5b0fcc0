"""cursor-sync admissions that arrive together share one commit (`SyncControl.admit`), on
real Delta tables: each decided in arrival order and seeing the ones before it (a group
created in the batch is joined in the batch), refused ones refused, and a restart's fold of
the table equals the state in memory."""

from __future__ import annotations

import asyncio

from delta_tables.layout import Layout
from delta_tables.sync_control import SyncControl
from delta_tables.sync_state import load_state, table_paths

GROUPS = [bytes([0x60 + g]) * 32 for g in range(6)]


def device(g: int, n: int) -> bytes:
    return bytes([g, n]) * 16


def test_a_wave_of_admissions_shares_commits_and_survives_a_restart(settings):
    layout = Layout.of(settings)
    layout.ensure_shared_tables()

    async def wave():
        c = SyncControl(layout, fsync=False)
        await c.load()
        writes0 = c.writes
        calls = []
        for g, group in enumerate(GROUPS):
            first = device(g, 0)
            calls.append(c.admit(group, first, None))                  # creates the group
            calls += [c.admit(group, device(g, n), first) for n in range(1, 8)]   # admitted
            calls.append(c.admit(group, device(g, 99), device(g, 50)))  # admitter no member
            calls.append(c.admit(group, first, None))                  # already a member
        outcomes = await asyncio.gather(*calls)
        per_group = len(outcomes) // len(GROUPS)
        for g in range(len(GROUPS)):
            assert outcomes[g * per_group:(g + 1) * per_group] == \
                ["created"] + ["joined"] * 7 + ["refused", "member"]
        commits = c.writes - writes0
        assert 1 <= commits <= 3, commits        # 42 new members, not 42 commits
        # open groups: anyone not revoked joins an existing group, also in a batch
        assert await asyncio.gather(c.admit(GROUPS[0], device(0, 60), None, open_group=True),
                                    c.admit(GROUPS[0], device(0, 61), None)) == \
            ["joined", "refused"]
        assert await c.revoke(GROUPS[1], device(1, 3), device(1, 0))
        assert await c.admit(GROUPS[1], device(1, 3), device(1, 0)) == "refused"
        members = {g: set(m) for g, m in c.state.members.items()}
        await c.close()
        return members

    members = asyncio.run(wave())
    fold = load_state(table_paths(layout))
    assert {g: set(m) for g, m in fold.members.items()} == members
    assert members[GROUPS[0]] == {device(0, n) for n in (*range(8), 60)}
    assert members[GROUPS[1]] == {device(1, n) for n in range(8) if n != 3}
