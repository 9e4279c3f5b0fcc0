"""`relay bench --peer`: our side's client shape against a real PPP listener, the summary's
medians and ratios, and the peer's one pin; for nostr-rs-relay its config, its build cache and
the durability statements; the crash check's id bookkeeping. (The peers themselves are
installed or built and run by the command, not by the default tests: nostr-relay comes from
PyPI into its own virtualenv, nostr-rs-relay is built with cargo.)"""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from relay import cli
from relay.bench import peer, peer_rs

from test_ppp_client import relay_node  # noqa: F401  (fixture: a PPP IngressNode in a thread)


def test_ppp_senders_shape_stores_one_after_another_past_the_budget(relay_node):  # noqa: F811
    """Two sequential senders for 2 s: every STORE got STORED; one sender's identity may
    STORE 60 a minute (C.3), so past 60 the shape must have logged in as a new one."""
    port = relay_node.node.ppp.bound_port
    out = subprocess.run([sys.executable, str(peer.CLIENTS), "ppp", "--port", str(port),
                          "senders", "--clients", "2", "--seconds", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["clients"] == 2 and res["acked"] == len(res["ack_ms"]) > 60
    assert res["acked_per_s"] > 0
    assert relay_node.node.appender.rows_committed == res["acked"]


def test_summary_is_the_median_over_rounds_with_ours_over_peer():
    def run(rate, ms):
        r = {f"senders_{n}": {"acked_per_s": rate, "ack_ms": {"p50": ms, "p99": 2 * ms}}
             for n in peer.SENDERS}
        r["delivery_ms"] = {"p50": ms, "p99": 3 * ms}
        return r
    rounds = [{"ours": run(100, 4.0), "peer": run(200, 2.0)},
              {"ours": run(300, 6.0), "peer": run(100, 1.0)},
              {"ours": run(200, 5.0), "peer": run(400, 2.0)}]
    s = peer.summarize(rounds)
    assert s["senders_1.acked_per_s"] == {"ours": 200, "peer": 200, "ours_over_peer": 1.0}
    assert s["delivery_ms.p50"] == {"ours": 5.0, "peer": 2.0, "ours_over_peer": 2.5}
    assert s["senders_64.ack_ms.p99"]["ours_over_peer"] == 2.5


def test_the_peer_is_pinned_once():
    assert peer.peer_requirement() == ["nostr-relay==1.14"]


# --- nostr-rs-relay (built by the command, never here) and the added figures ---------------

def test_ppp_crash_shape_ids_are_the_ones_on_disk(relay_node, settings):  # noqa: F811
    """The crash check's two halves on a live relay (no kill): the ids the `crash` shape
    reports as STORED are read back from the Delta tables on disk by `_landed_ids`."""
    port = relay_node.node.ppp.bound_port
    out = subprocess.run([sys.executable, str(peer.CLIENTS), "ppp", "--port", str(port),
                          "crash", "--clients", "3", "--seconds", "1.5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    acked = json.loads(out.stdout.strip().splitlines()[-1])["acked_ids"]
    assert len(acked) > 10 and len(set(acked)) == len(acked)
    on_disk = peer._landed_ids(Path(settings.data_dir))
    assert peer._verdict(acked, on_disk) == {"acked_before_kill": len(acked), "lost": 0}
    assert peer._verdict(acked + ["00" * 32], on_disk)["lost"] == 1


def test_nostr_rs_relay_runs_on_loopback_with_its_database_in_the_work_dir(tmp_path):
    conf = tomllib.loads(peer_rs.config_toml(43123, tmp_path / "db"))
    assert conf["network"] == {"address": "127.0.0.1", "port": 43123}
    assert conf["database"] == {"data_directory": str(tmp_path / "db")}
    # everything else is its shipped config.toml's (which sets only these)
    assert conf["options"] == {"reject_future_seconds": 1800}


def test_durability_is_stated_for_both_sides_and_matches_the_pinned_source():
    assert "fsync" in peer.OURS_DURABILITY
    rs = peer.PEERS["nostr-rs-relay"]
    assert rs.version == peer_rs.VERSION and "synchronous=NORMAL" in rs.durability
    assert "not fsynced" in rs.durability and "not fsynced" in peer.PEERS["nostr-relay"].durability
    # The statement is read from its source: check it against the crate when cargo has it.
    src = [p for p in (Path.home() / ".cargo" / "registry" / "src").glob(
        f"*/nostr-rs-relay-{peer_rs.VERSION}/src")]
    if src:
        pragmas = (src[0] / "repo" / "sqlite_migration.rs").read_text()
        assert "PRAGMA journal_mode = WAL;" in pragmas
        assert "PRAGMA main.synchronous=NORMAL;" in pragmas
        assert "Notice::saved" in (src[0] / "db.rs").read_text()


def test_build_only_uses_the_cached_build(tmp_path, monkeypatch, capsys):
    """`relay bench --peer nostr-rs-relay --build-only`: with the pinned version already in
    the cache (here a stand-in file), nothing is built and the command says it is ready."""
    monkeypatch.setenv("SPARK_RELAY_CACHE", str(tmp_path))
    exe = peer_rs.binary()
    assert exe == tmp_path / "peers" / f"nostr-rs-relay-{peer_rs.VERSION}" / "bin" / \
        "nostr-rs-relay"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--peer", "nostr-rs-relay", "--build-only"])
    assert e.value.code == 0
    assert f"nostr-rs-relay {peer_rs.VERSION} is ready" in capsys.readouterr().out


def test_summary_sums_the_crash_checks_and_states_the_targets():
    def run(rate, ms, lost):
        r = {f"senders_{n}": {"acked_per_s": rate, "ack_ms": {"p50": ms, "p99": 2 * ms},
                              "cpu_us_per_event": 100} for n in peer.SENDERS}
        r["delivery_ms"] = {"p50": ms, "p99": 3 * ms}
        r["idle"] = {"pss_mib": 50, "rss_mib": 60}
        r["start"] = {"first_ack_ms": 300}
        r["crash"] = {"acked_before_kill": 100, "lost": lost}
        return r
    rounds = [{"ours": run(300, 4.0, 0), "peer": run(200, 1.0, 0)},
              {"ours": run(300, 4.0, 0), "peer": run(200, 1.0, 2)}]
    s = peer.summarize(rounds)
    assert s["crash"] == {"ours": {"acked_before_kill": 200, "lost": 0},
                          "peer": {"acked_before_kill": 200, "lost": 2}}
    assert s["start.first_ack_ms"]["ours_over_peer"] == 1.0
    t = peer.targets(s)
    assert t["senders_16.acked_per_s"]["met"] is True
    assert t["senders_1.ack_ms.p50"] == {"ours_over_peer": 4.0, "target": "<= 2.0", "met": False}
    assert t["crash.lost"]["met"] is False
