"""The inbox stream on a Spark standalone cluster started by `relay spark master|worker` from the
installed pyspark (issue 18): executors on the worker read the landing files and run the Python
data source, the driver commits the inbox; the cluster admits only drivers with the secret."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from delta_tables.layout import Layout

from landing_rows import envelope, land, landing_row
from relay_up_process import free_port
from test_inbox_stream import MB, assert_gap_free, read

pytestmark = pytest.mark.cluster


def _daemon(args, data, log):
    return subprocess.Popen([sys.executable, "-m", "relay.cli", "--data-dir", str(data),
                             "spark", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except OSError:
        return 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("standalone")
    data = tmp_path / "data"
    port, ui, worker_ui = free_port(), free_port(), free_port()
    logs = tmp_path / "master.log", tmp_path / "worker.log"
    procs = []
    with open(logs[0], "w") as mlog, open(logs[1], "w") as wlog:
        procs.append(_daemon(["master", "--port", str(port), "--webui-port", str(ui)],
                             data, mlog))
        # two workers of one core each: two executors, between which the stream's two state
        # partitions are placed
        for w in (worker_ui, free_port()):
            procs.append(_daemon(["worker", f"spark://127.0.0.1:{port}", "--cores", "1",
                                  "--memory", "1g", "--webui-port", str(w)], data, wlog))
        try:
            deadline = time.monotonic() + 90
            while _alive_workers(ui) < 2:
                assert time.monotonic() < deadline, logs[1].read_text()[-3000:]
                assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
                time.sleep(0.5)
            yield data, f"spark://127.0.0.1:{port}", logs
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                p.wait(30)


def test_stream_on_a_standalone_cluster(cluster, tmp_path):
    data, master, (master_log, worker_log) = cluster
    assert (data / "keys" / "spark_secret").stat().st_mode & 0o077 == 0
    layout = Layout(data)
    rows = [landing_row(MB[i % 3], envelope(i)) for i in range(90)]
    land(layout, rows, node="node-a", per_commit=15)
    land(layout, rows[:30], node="node-b", per_commit=10)   # re-landed elsewhere: duplicates
    conf = tmp_path / "relay.toml"
    conf.write_text("[stream]\nstate_store = true\nmax_files_per_trigger = 3\n")
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "--conf", str(conf),
                           "--data-dir", str(data), "stream", "--master", master,
                           "--available-now"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inbox = read(layout.inbox)
    assert inbox.num_rows == 90
    assert_gap_free(inbox)
    assert read(layout.rejects).num_rows == 30
    # the state store's partitions were held by the two workers' executors
    placed = [json.loads(line)["executors"] for line in proc.stdout.splitlines() + \
              proc.stderr.splitlines() if '"stream_state_partitions"' in line]
    assert placed, proc.stdout[-2000:]
    assert len(set(placed[-1].values())) == 2, placed
    # the executors ran on the worker (its work directory holds the application's)
    assert any((data / "spark-work").iterdir())
    # the daemons ran with authentication; the secret is on no command line
    secret = (data / "keys" / "spark_secret").read_text().strip()
    assert "authentication enabled" in master_log.read_text()
    for p in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout \
            .splitlines():
        assert secret not in p


def test_a_driver_without_the_secret_is_refused(cluster):
    data, master, _ = cluster
    probe = ("from pyspark.sql import SparkSession\n"
             f"s = SparkSession.builder.master({master!r}).config('spark.authenticate', 'true')"
             ".config('spark.authenticate.secret', 'not-the-secret')"
             ".config('spark.ui.enabled', 'false').getOrCreate()\n"
             "print(s.range(10).repartition(2).count())\n")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:     # still waiting for the master that never admits it
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert "10" not in out.split()
