"""`relay bench --peer`: our side's client shape against a real PPP listener, the summary's
medians and ratios, and the peer's one pin. (The peer itself is installed and run by the
command, not by the default tests: it comes from PyPI into its own virtualenv.)"""

import json
import subprocess
import sys

from relay.bench import peer

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
