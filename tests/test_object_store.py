"""Delta commits on a real S3-compatible server (moto's server mode on loopback, issue 18):
two writers racing on one table never both commit one version, nor one writer-counter value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from delta_tables import writer_fence
from delta_tables.object_store import S3Location
from relay.bench.s3_server import BUCKET, s3_server

WRITER = Path(__file__).with_name("s3_fenced_writer.py")
SCHEMA = pa.schema([("writer", pa.string()), ("i", pa.int64())])


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        yield url


def test_two_writers_racing_on_s3_never_share_a_version(endpoint):
    uri, per_writer = f"s3://{BUCKET}/race", 12
    opts = S3Location(endpoint).storage_options()
    write_deltalake(uri, SCHEMA.empty_table(), storage_options=opts)
    procs = [subprocess.Popen([sys.executable, str(WRITER), endpoint, uri, name,
                               str(per_writer)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
             for name in ("a", "b")]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    dt = DeltaTable(uri, storage_options=opts)
    fence = writer_fence.fence_id("race")
    assert dt.version() == 2 * per_writer          # version 0 created the table
    rows = dt.to_pyarrow_table().to_pylist()
    assert sorted((r["writer"], r["i"]) for r in rows) == sorted(
        (w, i) for w in "ab" for i in range(per_writer))
    # every version holds one writer's commit, and the counter went up by one each time
    counters = []
    for v in range(1, dt.version() + 1):
        dt.load_as_version(v)
        counters.append(writer_fence.read(dt, fence))
    assert counters == list(range(1, 2 * per_writer + 1))
    print("lost races:", [int(o[1]) for o in outs])



def test_node_ids_are_claimed_on_s3_too(endpoint, tmp_path):
    """The owner record of a node id on S3 is a Delta table created by a conditional PUT: a
    second state directory (another host) is refused, the owner's restart is not."""
    from delta_tables.node_claim import NodeClaim, NodeIdTaken
    from delta_tables.object_store import configure_env, table_root
    loc = S3Location(endpoint)
    configure_env(loc)
    landing = table_root(f"s3://{BUCKET}/claims", loc) / "landing"
    first = NodeClaim(landing, tmp_path / "a", "node-1").acquire()
    with pytest.raises(NodeIdTaken, match=str(tmp_path / "a")):
        NodeClaim(landing, tmp_path / "b", "node-1").acquire()
    first.release()
    NodeClaim(landing, tmp_path / "a", "node-1").acquire().release()
