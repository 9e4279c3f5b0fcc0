"""Where everything lives under the data directory, and creating tables on first start.

    <tables>/landing/<node>/g<NNNNNN>   one landing table per ingress node and generation
    <tables>/{inbox,acks,rejects,padding_audit}
    <data>/checkpoints/inbox_stream     Spark checkpoint (configurable)
    <data>/state/landing_consumed.json  the stream's last committed landing offsets
                                        (<tables>/_relay/ when the tables are on S3)
    <data>/keys/                        relay static keys (mode 0600)

`<tables>` is `<data>/tables`, or `tables_dir` (a local directory or `s3://bucket/prefix`,
delta_tables/object_store.py): the tables are shared by every host, `<data>` is each host's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import pyarrow as pa

from . import object_store
from .schema import ACKS, INBOX, LANDING, PADDING_AUDIT, REJECTS, TableDef

if TYPE_CHECKING:
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

# deltalake and pyarrow.dataset are imported where used: the stream's source runner (a Python
# process Spark starts for the `landing` source) reads this module only for paths and the
# landing tables' list, and would hold ~35 MiB more for the two (issue 20, idle memory).

GENERATION_RE = re.compile(r"^g(\d{6})$")


class Layout:
    def __init__(self, data_dir: str | os.PathLike, tables=None):
        """`tables`: a path object for the tables (object_store.table_root), default
        `<data_dir>/tables`. Use `Layout.of(settings)` in the relay's processes."""
        self.root = Path(data_dir).resolve()
        self._tables = tables if tables is not None else self.root / "tables"

    @classmethod
    def of(cls, settings) -> "Layout":
        """The layout the settings describe; with tables on S3 it also points this process's
        delta-rs and pyarrow (and its Spark workers) at the object store."""
        return cls.at(settings.data_dir, settings.tables_dir, settings.object_store.endpoint,
                      settings.object_store.region)

    @classmethod
    def at(cls, data_dir, tables_dir: str = "", endpoint: str = "",
           region: str = "us-east-1") -> "Layout":
        if not tables_dir:
            return cls(data_dir)
        s3 = object_store.S3Location(endpoint, region)
        if tables_dir.startswith("s3://"):
            object_store.configure_env(s3)
        return cls(data_dir, object_store.table_root(tables_dir, s3))

    def options(self) -> dict[str, str]:
        """What `Layout.at` needs to rebuild this layout in another process (a Spark data
        source's Python worker: it reads the tables too)."""
        opts = {"data_dir": str(self.root), "tables_dir": str(self.tables)}
        if self.s3 is not None:
            opts.update(s3_endpoint=self.s3.endpoint, s3_region=self.s3.region)
        return opts

    @property
    def remote(self) -> bool:
        return object_store.is_remote(self._tables)

    @property
    def s3(self) -> object_store.S3Location | None:
        """Where the tables are when they are on S3 (None on a local disk)."""
        return self._tables.location if self.remote else None

    # --- paths -------------------------------------------------------------------------
    @property
    def tables(self) -> Path:
        return self._tables

    @property
    def landing_root(self) -> Path:
        return self.tables / "landing"

    def table(self, tdef: TableDef) -> Path:
        return self.tables / tdef.name

    def table_paths(self, tdefs: Mapping[str, TableDef]) -> dict[str, Path]:
        """Table name -> path, for tables declared together (a protocol's control tables)."""
        return {name: self.table(tdef) for name, tdef in tdefs.items()}

    @property
    def inbox(self) -> Path:
        return self.table(INBOX)

    @property
    def acks(self) -> Path:
        return self.table(ACKS)

    @property
    def rejects(self) -> Path:
        return self.table(REJECTS)

    @property
    def padding_audit(self) -> Path:
        return self.table(PADDING_AUDIT)

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def landing_consumed_file(self) -> Path:
        # with shared tables, shared too: compaction may run on another host than the stream
        if self.remote:
            return self.tables / "_relay" / "landing_consumed.json"
        return self.state / "landing_consumed.json"

    def landing_generation(self, node: str, generation: int) -> Path:
        return self.landing_root / node / f"g{generation:06d}"

    def landing_tables(self, require_log: bool = True) -> dict[str, Path]:
        """All landing tables that exist, keyed `<node>/g<NNNNNN>`, in a stable order.
        `require_log=False`: every generation's directory, whether its log exists yet or not
        (on an object store, a listing per node and no request per generation)."""
        out: dict[str, Path] = {}
        if (require_log or not self.remote) and not self.landing_root.exists():
            return out      # (a listing of a missing prefix is empty: no request to ask)
        for node_dir in sorted(p for p in self.landing_root.iterdir() if p.is_dir()):
            for gen_dir in sorted(p for p in node_dir.iterdir() if p.is_dir()):
                if GENERATION_RE.match(gen_dir.name) and (
                        not require_log or (gen_dir / "_delta_log").exists()):
                    out[f"{node_dir.name}/{gen_dir.name}"] = gen_dir
        return out

    def generations(self, node: str) -> list[int]:
        node_dir = self.landing_root / node
        if not node_dir.exists():
            return []
        return sorted(int(m.group(1)) for p in node_dir.iterdir()
                      if (m := GENERATION_RE.match(p.name)) and (p / "_delta_log").exists())

    # --- consumed landing offsets (written by the stream's source on commit) -------------
    def read_landing_consumed(self) -> dict[str, int]:
        try:
            return json.loads(self.landing_consumed_file.read_text())
        except FileNotFoundError:
            return {}

    def write_landing_consumed(self, offsets: dict[str, int]) -> None:
        if self.remote:     # one PUT replaces the object whole
            self.landing_consumed_file.write_text(json.dumps(offsets, sort_keys=True))
            return
        self.state.mkdir(parents=True, exist_ok=True)
        tmp = self.landing_consumed_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(offsets, sort_keys=True))
        os.replace(tmp, self.landing_consumed_file)

    # --- creation ----------------------------------------------------------------------
    def ensure_shared_tables(self) -> None:
        """Create inbox, acks, rejects and padding_audit if missing (idempotent)."""
        for tdef in (INBOX, ACKS, REJECTS, PADDING_AUDIT):
            ensure_table(self.table(tdef), tdef)

    def ensure_tables(self, tdefs: Mapping[str, TableDef]) -> dict[str, Path]:
        """Create these tables if missing (idempotent); returns their paths."""
        paths = self.table_paths(tdefs)
        for name, tdef in tdefs.items():
            ensure_table(paths[name], tdef)
        return paths

    def ensure_landing(self, node: str, generation: int) -> Path:
        path = self.landing_generation(node, generation)
        ensure_table(path, LANDING)
        return path


def ensure_table(path: Path, tdef: TableDef) -> DeltaTable:
    """Create an empty table with the definition's schema and properties, or open it."""
    from deltalake import DeltaTable

    if (path / "_delta_log").exists():
        return DeltaTable(str(path))
    path.mkdir(parents=True, exist_ok=True)
    try:
        return DeltaTable.create(str(path), schema=tdef.arrow_schema(), mode="error",
                                 name=tdef.name, configuration=tdef.properties)
    except Exception:
        # Two processes racing to create the same table: the loser opens the winner's table.
        if (path / "_delta_log").exists():
            return DeltaTable(str(path))
        raise


def equals(column: str, value: str | bytes) -> ds.Expression:
    """`column == value` as a filter of `DeltaTable.to_pyarrow_dataset()`. Files delta-rs
    rewrites (compaction's OPTIMIZE and MERGE) store strings and binaries as string_view /
    binary_view, appended files as string / binary, and pyarrow has no comparison kernel
    across the two ("Function 'equal' has no kernel matching input types (string,
    string_view)"): comparing the column cast to the plain type works on every file."""
    import pyarrow.dataset as ds

    plain = pa.string() if isinstance(value, str) else pa.binary()
    return ds.field(column).cast(plain) == value
