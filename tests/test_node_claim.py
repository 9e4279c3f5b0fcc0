"""Ingress node ids are unique by construction (issue 18): one state directory and one live
process per node id, or the second is refused before it writes a landing generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from delta_tables.node_claim import NodeClaim, NodeIdTaken


def test_one_process_one_state_directory_per_node(tmp_path):
    landing = tmp_path / "tables" / "landing"
    host_a, host_b = tmp_path / "a" / "state", tmp_path / "b" / "state"
    first = NodeClaim(landing, host_a, "node-1").acquire()
    with pytest.raises(NodeIdTaken, match="already running"):
        NodeClaim(landing, host_a, "node-1").acquire()          # started twice by mistake
    with pytest.raises(NodeIdTaken, match=str(host_a)):
        NodeClaim(landing, host_b, "node-1").acquire()          # another host's state dir
    other = NodeClaim(landing, host_b, "node-2").acquire()      # its own id: fine
    first.release()
    NodeClaim(landing, host_a, "node-1").acquire().release()    # the owner restarts
    with pytest.raises(NodeIdTaken):                            # still not the other's
        NodeClaim(landing, host_b, "node-1").acquire()
    other.release()
    owner = json.loads((landing / "node-1" / "_owner.json").read_text())
    assert owner["state"] == str(host_a) and len(owner["token"]) == 32


def test_a_second_ingress_with_the_same_node_id_is_refused(tmp_path):
    """`relay ingress --protocol trueseal` twice on one data directory: the second exits 2
    with the reason, without a landing generation of its own; the first keeps serving."""
    from relay_up_process import free_port
    env = dict(os.environ, RELAY_DATA_DIR=str(tmp_path / "data"), RELAY_LOG_FORMAT="json",
               RELAY_METRICS_PORT_INGRESS="0", RELAY_TRUESEAL_PUSH_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "relay.cli", "ingress", "--protocol", "trueseal"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        assert json.loads(first.stdout.readline())["ready"]
        gens = sorted(p.name for p in (tmp_path / "data" / "tables" / "landing" /
                                       "node-0-trueseal").iterdir())
        env2 = dict(env, RELAY_TRUESEAL_PUSH_PORT=str(free_port()))
        second = subprocess.run(cmd, env=env2, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert "already running" in second.stderr and "node_id_taken" in second.stderr
        assert sorted(p.name for p in (tmp_path / "data" / "tables" / "landing" /
                                       "node-0-trueseal").iterdir()) == gens
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)
