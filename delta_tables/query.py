"""SQL over Delta tables with delta-rs's DataFusion, answered in the tables' own Arrow types.

DataFusion rather than a pyarrow dataset scan: Arrow's scanner threads can abort the
interpreter at exit (tests/test_compaction.py). DataFusion answers strings and binaries as
string_view / binary_view; merge sources and callers want plain string / binary.
"""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder


def sql(tables: dict[str, DeltaTable], query: str) -> pa.Table:
    qb = QueryBuilder()
    for name, dt in tables.items():
        qb.register(name, dt)
    out = pa.table(qb.execute(query).read_all())
    return out.cast(pa.schema([pa.field(f.name, _unview(f.type), f.nullable)
                               for f in out.schema]))


def _unview(t: pa.DataType) -> pa.DataType:
    if t == pa.binary_view():
        return pa.binary()
    if t == pa.string_view():
        return pa.string()
    return t
