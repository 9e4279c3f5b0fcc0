"""`relay.bench.harness.write_conf`: a bench's child relay gets exactly the bench's settings."""

from relay.bench import harness
from runtime import config


def test_write_conf_round_trips(tmp_path):
    s = config.load(None, env={}, data_dir=str(tmp_path / "d"))
    s.sync.messages_per_minute = 10 ** 9
    s.ppp.notify_window_ms = 0
    s.heya.enabled = False
    s.stream.cursor_start = {}
    s.bind = 'a "quoted" \\ value'
    path = harness.write_conf(s, tmp_path / "relay.toml")
    assert config.as_dict(config.load(path, env={})) == config.as_dict(s)


def test_every_target_says_how_far_off_it_is():
    from relay.bench.run import targets
    t = targets({"trueseal": {"pipelined": {"acked_per_s": 10_000}},
                 "push_to_deliver_ms": {"p50": 200, "p99": 1200}})
    assert t["trueseal_pipelined_per_s"]["short_by"] == 2.0          # at least 20,000
    assert t["push_to_deliver_p50_ms"] == {"target": 250, "kind": "at most", "measured": 200,
                                           "short_by": 0.8, "met": True}
    assert t["push_to_deliver_p99_ms"]["short_by"] == 2.0            # at most 600
    assert t["sync_pushes_per_s"]["measured"] is None and not t["sync_pushes_per_s"]["met"]
