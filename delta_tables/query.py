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


def rows(tables: dict[str, DeltaTable], query: str) -> list[dict]:
    """`sql`'s answer as a list of dicts."""
    return sql(tables, query).to_pylist()


def read(dt: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """The whole of `dt` (or `columns` of it) in its own Arrow types, through DataFusion: for
    a command that reads and exits at once, where a pyarrow scan's teardown can abort it."""
    names = "*" if columns is None else ", ".join(f'"{c}"' for c in columns)
    out = sql({"t": dt}, f"SELECT {names} FROM t")
    if columns is None:
        columns = [f.name for f in dt.schema().fields]
    return out.select(columns)


def _unview(t: pa.DataType) -> pa.DataType:
    if t == pa.binary_view():
        return pa.binary()
    if t == pa.string_view():
        return pa.string()
    return t
