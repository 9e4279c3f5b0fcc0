"""Shared fixtures: one SparkSession for the whole run (local[2]), settings on free ports, a layout."""

from __future__ import annotations

import pytest

from delta_tables.layout import Layout
from runtime import config


@pytest.fixture(scope="session")
def spark():
    from jobs.spark_session import get_spark
    session = get_spark("local[2]", "relay-tests")
    yield session
    session.stop()


@pytest.fixture
def settings(tmp_path):
    s = config.load(None, env={}, data_dir=str(tmp_path / "data"))
    s.trueseal.push_port = 0
    s.trueseal.receive_port = 0
    s.heya.port = 0
    s.ppp.port = 0
    s.sync.port = 0
    return s


@pytest.fixture
def layout(settings):
    lay = Layout(settings.data_dir)
    lay.ensure_shared_tables()
    return lay


from traffic_run import traffic  # noqa: E402,F401  (session fixture: metrics and logs tests)
