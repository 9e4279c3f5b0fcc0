"""Exactly-once appends for the stream's sink, committed directly (~2 ms instead of ~10).

The sink commits each micro-batch's rows to `inbox`, `padding_audit` and `rejects` with a
Delta app transaction (`<app id>` -> batch id): a replayed batch finds its marker and is
skipped, so each lands exactly once; the inbox's commits also carry the writer counter
(writer_fence.py). Through delta-rs each such commit cost ~7 ms of `write_deltalake`, ~2 ms
of fsyncs after it and ~2 ms per `transaction_version` lookup (a py-spy profile of
`jobs.batch_profile`, 2026-11-28: ~18 ms of a 4-row batch's ~27 ms sink), and the inbox's
is on the path of every Heya HAVE and cursor-sync NOTIFY.

So on a local disk the commit is a direct append (direct_append.py: the Parquet file, the
commit file with the `txn` actions, four fsyncs, `link()` to the next version), and what the
sink asks of the table is answered from what this writer knows, not re-read:

* the table as of one snapshot (opened here, or the caller's: the inbox's is the one the
  stream built its cursor cache from), plus this writer's own commits since;
* when the next version is taken (compaction, or another stream), a fresh snapshot decides,
  as delta-rs's conflict check would: a commit of the same app transaction already landed
  (`AlreadyCommitted`, a replay) or the writer counter moved (`WriterLost`) and the commit is
  dropped; anything else (compaction's rewrites and deletes touch no marker) and it goes in
  at the next free version. A table whose protocol asks more of writers than this one does
  (writer version above 2: deletion vectors, column mapping, constraints) is refused, and the
  sink commits through delta-rs instead.

Checkpoints: delta-rs writes one after a commit whose version is a multiple of the table's
`delta.checkpointInterval`; so does this writer, after the batch (`checkpoint_due`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from . import log_retention
from .direct_append import DirectAppender, stats_columns_of
from .schema import TableDef
from .writer_fence import WriterLost

log = logging.getLogger("relay.txn_append")

MAX_WRITER_VERSION = 2   # what a plain append honours: nullability (invariants need none here)


class AlreadyCommitted(Exception):
    """The table already holds this app transaction's commit (a replayed batch)."""


class UnsupportedTable(Exception):
    """The table's protocol asks more of a writer than a direct append does."""


def _check_protocol(dt: DeltaTable) -> None:
    protocol = dt.protocol()
    if protocol.min_writer_version > MAX_WRITER_VERSION:
        raise UnsupportedTable(f"writer version {protocol.min_writer_version}")


class TxnAppender:
    """Appends to one local Delta table, each commit carrying app transactions."""

    def __init__(self, path: Path, tdef: TableDef, *, dt: DeltaTable | None = None,
                 fsync: bool = True):
        self.path = Path(path)
        self._dt = dt if dt is not None else DeltaTable(str(self.path))
        _check_protocol(self._dt)
        self.checkpoint_interval = int(
            self._dt.metadata().configuration.get("delta.checkpointInterval", "100"))
        schema = tdef.arrow_schema()
        self._appender = DirectAppender(self.path, schema, fsync=fsync,
                                        stats_columns=stats_columns_of(schema),
                                        version=self._dt.version())
        self._txns: dict[str, int | None] = {}   # as of self._appender.version
        self._checkpointed = self._appender.version

    @property
    def version(self) -> int:
        return self._appender.version

    def txn_version(self, app_id: str) -> int | None:
        """The version of `app_id`'s newest transaction in the table as this writer knows it."""
        if app_id not in self._txns:
            try:
                self._txns[app_id] = self._dt.transaction_version(app_id)
            except DeltaError as exc:
                # the lookup reads the log of the snapshot this writer adopted; compaction
                # may have deleted that part of it since (log_retention.py): the table now
                if not log_retention.outlived(exc):
                    raise
                self.refresh()
                self._txns[app_id] = self._dt.transaction_version(app_id)
        return self._txns[app_id]

    def _check(self, txns: dict[str, int], fence: str | None) -> None:
        for app_id, version in txns.items():
            seen = self.txn_version(app_id)
            if app_id == fence:
                if (seen or 0) != version - 1:
                    raise WriterLost(f"another writer committed to {self.path} (writer counter "
                                     f"{seen or 0}, this writer's view is as of {version - 1})")
            elif seen is not None and seen >= version:
                raise AlreadyCommitted(f"{app_id} {seen} >= {version}")

    def refresh(self) -> None:
        """Forget what this writer knew: the table as it is now."""
        self._adopt(DeltaTable(str(self.path)))

    def _adopt(self, dt: DeltaTable) -> None:
        """Know the table as of `dt` from now on (its markers are read from it when asked)."""
        _check_protocol(dt)
        self._dt, self._txns = dt, {}
        self._appender.version = dt.version()

    def append(self, data: pa.Table, txns: dict[str, int], *, fence: str | None = None,
               marks: dict[str, int] | None = None) -> int:
        """Commit `data` with `txns` (app id -> version) once durable; returns the version.
        Each transaction must be newer than the table's, and `fence`'s exactly one newer:
        otherwise AlreadyCommitted or WriterLost, and nothing was committed. `marks`: more
        app transactions written as they are, unchecked (what a commit records, such as the
        landing versions it took, not what makes it exactly once)."""
        self._check(txns, fence)

        def taken(_version: int) -> int:
            self.refresh()
            self._check(txns, fence)
            return self._appender.version + 1

        written = {**(marks or {}), **txns}
        version = self._appender.append(data, txns=written, on_taken=taken)
        self._txns.update(written)
        return version

    def checkpoint_due(self) -> bool:
        return (self.version // self.checkpoint_interval
                > self._checkpointed // self.checkpoint_interval)

    def checkpoint(self) -> None:
        """A checkpoint of the table as it is now (delta-rs writes it), so readers load it
        from there instead of replaying the commits."""
        dt = DeltaTable(str(self.path))
        dt.create_checkpoint()
        self._checkpointed = dt.version()
        if dt.version() != self.version:   # someone else committed meanwhile: start over
            self._adopt(dt)
