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
