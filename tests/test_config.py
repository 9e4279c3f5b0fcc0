"""conf/relay.toml documents the defaults: keep it true to the code."""

import dataclasses
import tomllib
from pathlib import Path

from runtime import config

ROOT = Path(__file__).resolve().parents[1]


def test_conf_file_equals_builtin_defaults():
    with open(ROOT / "conf" / "relay.toml", "rb") as fh:
        data = tomllib.load(fh)
    assert data == dataclasses.asdict(config.Settings())


def test_environment_overrides_file(tmp_path):
    s = config.load(ROOT / "conf" / "relay.toml", env={
        "RELAY_DATA_DIR": str(tmp_path), "RELAY_TRUESEAL_PUSH_PORT": "17701",
        "RELAY_TRUESEAL_RECEIVE_PORT": "17700", "RELAY_TRUESEAL_MAX_ENVELOPE": "1000",
        "RELAY_BIND": "0.0.0.0"})
    assert (s.data_dir, s.trueseal.push_port, s.trueseal.receive_port,
            s.trueseal.max_envelope, s.bind) == (str(tmp_path), 17701, 17700, 1000, "0.0.0.0")


def test_unknown_setting_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trueseal]\npush_prot = 1\n")
    try:
        config.load(bad, env={})
    except ValueError as exc:
        assert "push_prot" in str(exc)
    else:
        raise AssertionError("a misspelt setting must not be ignored")


def test_a_retired_setting_loads_with_a_warning(tmp_path, caplog):
    old = tmp_path / "old.toml"
    old.write_text("[ingress]\nrefresh_handle_every = 100\ncommits_per_generation = 7\n")
    s = config.load(old, env={})
    assert s.ingress.commits_per_generation == 7
    assert any("refresh_handle_every is retired" in r.getMessage() for r in caplog.records)
