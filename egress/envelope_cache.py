"""Envelope bytes of one protocol's live inbox rows, held in memory up to a byte budget.

The PPP and cursor-sync listeners serve FETCH / PULL from an in-memory view of their inbox
rows. Metadata (cursor, ids, expiry) is small and always held; envelopes are not: a recipient
offline for weeks must not cost the relay its backlog in RAM. The least recently used
envelopes beyond `budget` bytes are dropped here and read back from the inbox by their
relay-wide `seq` when asked for (one pyarrow scan per request, in a worker thread).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from delta_tables.layout import equals
from delta_tables.object_store import as_path
from delta_tables.schema import C


class EnvelopeCache:
    def __init__(self, inbox_path: Path, protocol: str, budget: int):
        self.inbox_path = as_path(inbox_path)
        self.protocol = protocol
        self.budget = budget
        self._held: OrderedDict[int, bytes] = OrderedDict()   # seq -> envelope, LRU first
        self.held_bytes = 0
        self.disk_reads = 0

    def __repr__(self) -> str:
        return f"EnvelopeCache({self.protocol}, held={len(self._held)}, bytes={self.held_bytes})"

    def put(self, seq: int, envelope: bytes) -> None:
        if seq in self._held:
            return
        self._held[seq] = envelope
        self.held_bytes += len(envelope)
        while self.held_bytes > self.budget and self._held:
            _, old = self._held.popitem(last=False)
            self.held_bytes -= len(old)

    def drop(self, seq: int) -> None:
        env = self._held.pop(seq, None)
        if env is not None:
            self.held_bytes -= len(env)

    async def get(self, seqs: list[int]) -> list[bytes | None]:
        """Envelopes in the order of `seqs`; None for a row the inbox no longer has."""
        missing = [s for s in seqs if s not in self._held]
        found: dict[int, bytes] = {}
        if missing:
            self.disk_reads += 1
            found = await asyncio.to_thread(self._read, missing)
        out = []
        for s in seqs:
            env = self._held.get(s)
            if env is not None:
                self._held.move_to_end(s)
            out.append(env if env is not None else found.get(s))
        return out

    def _read(self, seqs: list[int]) -> dict[int, bytes]:
        t = DeltaTable(str(self.inbox_path)).to_pyarrow_dataset().to_table(
            columns=[C.SEQ, C.ENVELOPE],
            filter=equals(C.PROTOCOL, self.protocol) & ds.field(C.SEQ).isin(seqs)
            & ds.field(C.ENVELOPE).is_valid(), use_threads=False)
        t = t.filter(pc.is_valid(t.column(C.ENVELOPE)))
        return dict(zip(t.column(C.SEQ).to_pylist(), t.column(C.ENVELOPE).to_pylist()))
