"""Writing the relay's commit files and reading its small ones cheaply.

A lone client's landing commit is a one-row file, and the stream's driver and the listeners
read such files one at a time: at a trickle of one sender, reading them was ~87% of the
sink's time in a py-spy profile (250 files a micro-batch, ~0.4 ms each). pyarrow's defaults
suit large files instead (measured here, one `landing` row with a 1,100-byte envelope,
2026-11-28):

* `read(use_threads=True)` hands every column to pyarrow's CPU pool: for a one-row file the
  hand-off is most of the work, 248 -> 117 µs a file without it. Opening a path resolves a
  filesystem and pre-buffers; reading the small file whole into memory first skips both.
  The micro-batch's read of 250 such files (`landing_source.read_files`, which also tags
  them together instead of one by one) went from 97 to 46 ms. On object stores the stream
  reads a landing file whole too, one GET (`object_store.read_objects`, several at once);
  other readers read the path as before (pre-buffering saves requests there).
* Parquet's own min/max statistics copy an opaque column's value (the envelope, up to 64 KiB,
  and `meta`) into the footer and page header twice: the one-row file is 7.7 KB with them and
  3.2 KB without, one page to write and fsync instead of two. Nothing filters on those
  columns; the others (ids, mailbox, times) keep theirs for readers that skip row groups.
* No compression, and no dictionary for the columns whose every value differs (event id,
  envelope, meta): a commit file is mostly ciphertext, which snappy cannot shrink, and a
  dictionary there only costs time. The other columns keep theirs (a mailbox repeats within
  a commit). 1,000 rows of the bench's landing rows: written in 444 instead of 655 µs, read
  in 228 instead of 337, the same size; one row 140 -> 132 µs. The size matters: a
  micro-batch above stream.driver_read_max_bytes is read by Spark's executors instead of
  the driver, 2-3x slower here (with dictionaries for strings only, the bench's 100k-row
  batch grew from 62.7 to 66.0 MiB, crossed the 64 MiB default and the stream measured
  34-63k instead of 86-109k envelopes/s). These files are short-lived as written: landing
  generations are dropped once consumed, and compaction rewrites the sink's small files
  with delta-rs's own settings.
"""

from __future__ import annotations

import pyarrow as pa

from .schema import C

# Columns whose values are opaque to the relay and never filtered on: no Parquet statistics.
OPAQUE = frozenset({C.ENVELOPE, C.META})
# Columns whose every value differs: a dictionary only costs time there.
UNIQUE = OPAQUE | {C.EVENT_ID}


def write_options(schema: pa.Schema) -> dict:
    """`pq.write_table` keyword arguments for a small commit's file of `schema`."""
    return {"compression": "NONE",
            "use_dictionary": [f.name for f in schema if f.name not in UNIQUE],
            "write_statistics": [f.name for f in schema if f.name not in OPAQUE]}


def read_small(path: str, columns: list[str] | None = None) -> pa.Table:
    """The rows of one small Parquet file (a local path or an object store URI)."""
    import pyarrow.parquet as pq

    if "://" in path:
        with pq.ParquetFile(path) as pf:
            return pf.read(columns=columns, use_threads=False)
    with open(path, "rb") as f:   # whole, at once: no filesystem to resolve, no pre-buffering
        data = f.read()
    return read_buffer(data, columns)


def read_buffer(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """The rows of one small Parquet file read whole into memory (from a disk or a store)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(pa.py_buffer(data)).read(columns=columns, use_threads=False)
