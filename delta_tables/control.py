"""What the owners of a protocol's control tables share (`heya_control.py`, `ppp_control.py`,
`sync_control.py`): the interface they implement, the writing they have in common.

A control plane (tokens, mailboxes, members, backups, push registrations: DESIGN.md
"Control-plane state") is a few small append-only tables (`schema_<protocol>.py`) folded into
memory (`<protocol>_state.py`), owned by the one process that serves the protocol. Its owner
writes a change first (one append, fsync'ed like a landing commit) and applies it to memory
only after the commit returned, with the fold the loader uses, so what a client was told
survives a crash and a restart rebuilds the same state. Changes are serialised by `lock`: they
are rare next to the protocol's messages, which never take it, and read-modify-write changes
then cannot interleave. Row times (`at`, unix microseconds) are strictly increasing per owner:
they order the fold and are compaction's MERGE key (`jobs/compact_step.py`).

An owner sets `tables`, calls `open()` from its `load()`, changes under `lock` with `write`,
and stores: policy (who may do what) is the shell's.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import pyarrow as pa

from .group_commit import DeltaAppendTarget
from .layout import Layout
from .schema import TableDef


def utc_micros() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1_000_000)


class ControlTables:
    tables: Mapping[str, TableDef] = {}   # the protocol's control tables, by name

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros):
        """`clock` returns unix microseconds (row times; tests move it)."""
        self.layout = layout
        self.fsync = fsync
        self.clock = clock
        self.lock = asyncio.Lock()
        self.paths: dict[str, Path] = {}
        self.targets: dict[str, DeltaAppendTarget] = {}
        self.writes = 0

    async def open(self, appended: Mapping[str, TableDef] | None = None) -> dict[str, Path]:
        """Create the tables if needed and an appender for each of `appended` (default: all);
        returns the tables' paths (what the owner's `load_state` reads)."""
        self.paths = await asyncio.to_thread(self.layout.ensure_tables, self.tables)
        self.targets = {name: DeltaAppendTarget(self.paths[name], tdef, fsync=self.fsync)
                        for name, tdef in (self.tables if appended is None else appended).items()}
        return self.paths

    def next_at(self, state) -> int:
        """The next row time: the clock, but after every `at` the fold has seen
        (`state.last_at`), which it then is."""
        at = max(self.clock(), state.last_at + 1)
        state.last_at = at
        return at

    async def write(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Append `rows` to `table` as one commit (durable when it returns)."""
        target = self.targets[table]
        data = pa.Table.from_pylist(rows, schema=target.schema)
        await asyncio.to_thread(target.commit, data)
        self.writes += 1
