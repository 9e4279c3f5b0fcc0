"""A writer process for tests/test_object_store.py: `count` fenced appends to one table on an
S3 server, as a stream does (delta_tables/writer_fence.py), reopening after each lost race the
way a restarted stream would. Prints `<committed> <lost>`."""

import sys

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from delta_tables import writer_fence
from delta_tables.object_store import S3Location

endpoint, uri, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
opts = S3Location(endpoint).storage_options()
fence = writer_fence.fence_id("race")
committed = lost = 0
while committed < count:
    dt = DeltaTable(uri, storage_options=opts)
    expected = writer_fence.read(dt, fence)       # the writer's "cache" is as of this counter
    try:
        txn = writer_fence.next_transaction(dt, fence, expected, uri)
        write_deltalake(dt, pa.table({"writer": [name], "i": [committed]}), mode="append",
                        commit_properties=CommitProperties(app_transactions=[txn]))
        committed += 1
    except (CommitFailedError, writer_fence.WriterLost):
        lost += 1
print(committed, lost)
