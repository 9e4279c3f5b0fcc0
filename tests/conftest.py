"""Shared fixtures: one SparkSession for the whole run (local[2]), settings on free ports, a layout.

`RELAY_TEST_TABLES=s3` puts every test's tables on an S3 server (moto's server mode on loopback,
one prefix per test) instead of its temporary directory: the README names the suites run so."""

from __future__ import annotations

import os

import pytest

from delta_tables.layout import Layout
from runtime import config

S3_MODE = os.environ.get("RELAY_TEST_TABLES", "") == "s3"


@pytest.fixture(scope="session")
def s3_endpoint():
    if not S3_MODE:
        yield None
        return
    from relay.bench.s3_server import s3_server
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def spark(s3_endpoint):
    """Started after the S3 server (if any): Spark's Python workers inherit its credentials."""
    from jobs.spark_session import get_spark
    session = get_spark("local[2]", "relay-tests")
    yield session
    session.stop()


@pytest.fixture
def settings(tmp_path, s3_endpoint):
    s = config.load(None, env={}, data_dir=str(tmp_path / "data"))
    if s3_endpoint:
        from relay.bench.s3_server import BUCKET
        s.tables_dir = f"s3://{BUCKET}/{tmp_path.name}"
        s.object_store.endpoint = s3_endpoint
    s.trueseal.push_port = 0
    s.trueseal.receive_port = 0
    s.heya.port = 0
    s.ppp.port = 0
    s.sync.port = 0
    s.sync.iroh_port = 0
    return s


@pytest.fixture
def layout(settings):
    lay = Layout.of(settings)
    lay.ensure_shared_tables()
    return lay


from traffic_run import traffic  # noqa: E402,F401  (session fixture: metrics and logs tests)
