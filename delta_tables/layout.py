"""Where everything lives under the data directory, and creating tables on first start.

    <data>/tables/landing/<node>/g<NNNNNN>   one landing table per ingress node and generation
    <data>/tables/{inbox,acks,rejects,padding_audit}
    <data>/checkpoints/inbox_stream          Spark checkpoint (configurable)
    <data>/state/landing_consumed.json       the stream's last committed landing offsets
    <data>/keys/                             relay static keys (mode 0600)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable

from .schema import ACKS, INBOX, LANDING, PADDING_AUDIT, REJECTS, TableDef

GENERATION_RE = re.compile(r"^g(\d{6})$")


class Layout:
    def __init__(self, data_dir: str | os.PathLike):
        self.root = Path(data_dir).resolve()

    # --- paths -------------------------------------------------------------------------
    @property
    def tables(self) -> Path:
        return self.root / "tables"

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
        return self.state / "landing_consumed.json"

    def landing_generation(self, node: str, generation: int) -> Path:
        return self.landing_root / node / f"g{generation:06d}"

    def landing_tables(self) -> dict[str, Path]:
        """All landing tables that exist, keyed `<node>/g<NNNNNN>`, in a stable order."""
        out: dict[str, Path] = {}
        if not self.landing_root.exists():
            return out
        for node_dir in sorted(p for p in self.landing_root.iterdir() if p.is_dir()):
            for gen_dir in sorted(p for p in node_dir.iterdir() if p.is_dir()):
                if GENERATION_RE.match(gen_dir.name) and (gen_dir / "_delta_log").exists():
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
    plain = pa.string() if isinstance(value, str) else pa.binary()
    return ds.field(column).cast(plain) == value
