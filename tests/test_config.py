"""conf/relay.toml documents the defaults: keep it true to the code."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

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
    except config.ConfigError as exc:
        assert "push_prot" in str(exc)
    else:
        raise AssertionError("a misspelt setting must not be ignored")


def test_a_retired_setting_loads_with_a_warning(tmp_path, caplog):
    old = tmp_path / "old.toml"
    old.write_text("[ingress]\nrefresh_handle_every = 100\ncommits_per_generation = 7\n")
    s = config.load(old, env={})
    assert s.ingress.commits_per_generation == 7
    assert any("refresh_handle_every is retired" in r.getMessage() for r in caplog.records)


def test_every_setting_has_an_environment_variable_and_old_names_still_work():
    env = {config.env_name(d): None for d, _, _ in config.leaves()}
    assert len(env) == len(list(config.leaves()))
    s = config.load(None, env={
        "RELAY_PUSH__FCM__CA_FILE": "/ca.pem", "RELAY_PUSH__WINDOW_SECONDS": "2.5",
        "RELAY_PUSH__WEBPUSH__ALLOW_PRIVATE_ENDPOINTS": "true",
        "RELAY_PPP__DISCOVERY_PEPPER_ROTATION_HOURS": "1", "RELAY_DATA_DIR": "/d",
        "RELAY_STREAM__PADDING_BUCKETS": "[128, 512]", "RELAY_METRICS_PORT_PUSH": "0",
        "RELAY_HEYA_PORT": "18337", "PPP_TRUSTED_PROXIES": "10.0.0.0/8"})
    assert (s.push.fcm.ca_file, s.push.window_seconds, s.push.webpush.allow_private_endpoints,
            s.ppp.discovery_pepper_rotation_hours, s.data_dir, s.stream.padding_buckets,
            s.metrics.push_port, s.heya.port, s.ppp.trusted_proxies) == (
        "/ca.pem", 2.5, True, 1.0, "/d", [128, 512], 0, 18337, "10.0.0.0/8")
    # the rule's name wins over an older one
    assert config.load(None, env={"RELAY_HEYA_PORT": "1", "RELAY_HEYA__PORT": "2"}).heya.port == 2


@pytest.mark.parametrize("env, line", [
    ({"RELAY_PUSH__WINDOW_SECONDS": "soon"},
     "setting push.window_seconds = 'soon' (from RELAY_PUSH__WINDOW_SECONDS): must be a number "
     ">= 0 (input should be a valid number, unable to parse string as a number)"),
    ({"RELAY_PPP__DISCOVERY_PEPPER_ROTATION_HOURS": "0.0001"},
     "setting ppp.discovery_pepper_rotation_hours = 0.0001 (from "
     "RELAY_PPP__DISCOVERY_PEPPER_ROTATION_HOURS): must be a number at least 1/3600 (one "
     "second)"),
    ({"RELAY_COMPACTION__AUDIT_RETENTION_DAYS": "0"},
     "setting compaction.audit_retention_days = 0.0 (from "
     "RELAY_COMPACTION__AUDIT_RETENTION_DAYS): must be a number at least 1/86400 (one "
     "second)"),
    ({"RELAY_HEYA_PORT": "99999"},
     "setting heya.port = 99999 (from RELAY_HEYA_PORT): must be an integer from 0 to 65535"),
    ({"RELAY_TRUESEAL__MAX_CONNECTIONS": "-1"},
     "setting trueseal.max_connections = -1 (from RELAY_TRUESEAL__MAX_CONNECTIONS): must be an "
     "integer >= 0"),
    ({"RELAY_PUSH__WEBPUSH__ALLOW_PRIVATE_ENDPOINTS": "maybe"},
     "setting push.webpush.allow_private_endpoints = 'maybe' (from "
     "RELAY_PUSH__WEBPUSH__ALLOW_PRIVATE_ENDPOINTS): must be true or false (input should be a "
     "valid boolean, unable to interpret input)"),
    ({"RELAY_STREAM__STATE_STORE": "maybe"},
     "setting stream.state_store = 'maybe' (from RELAY_STREAM__STATE_STORE): must be true, "
     "false or \"auto\" (input should be a valid boolean, unable to interpret input) (and 1 "
     "more)"),
    ({"RELAY_PUSH__WINDOW": "1"},
     "unknown setting in the environment: RELAY_PUSH__WINDOW (settings are "
     "RELAY_<SECTION>__<KEY>, docs/reference/settings.md)"),
    ({"RELAY_STREAM__PADDING_BUCKETS": "256,1024"},
     "setting stream.padding_buckets = '256,1024' (from RELAY_STREAM__PADDING_BUCKETS): must be "
     "JSON, e.g. [256, 1024, 4096, 16384]"),
])
def test_a_bad_value_is_one_line_naming_setting_value_source_and_what_is_allowed(env, line):
    with pytest.raises(config.ConfigError) as e:
        config.load(None, env=env)
    assert str(e.value) == line


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[sync]\nnew_connection_cpu_share = 1.5\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(bad, env={})
    assert str(e.value) == (f"setting sync.new_connection_cpu_share = 1.5 (from {bad}): must "
                            "be a number from 0 to 1")
    bad.write_text('[trueseal\n')
    with pytest.raises(config.ConfigError, match=f"settings file {bad} is not TOML"):
        config.load(bad, env={})
    with pytest.raises(config.ConfigError, match="No such file"):
        config.load(tmp_path / "missing.toml", env={})


def test_a_pepper_period_under_a_second_cannot_divide_by_zero():
    from engine.ppp import discovery as D
    s = config.load(None, env={"RELAY_PPP__DISCOVERY_PEPPER_ROTATION_HOURS": str(1 / 3600)})
    rotation = max(1, round(s.ppp.discovery_pepper_rotation_hours * 3600))   # ingress/ppp_app.py
    assert rotation == 1 and D.pepper_id(10.5, rotation) == 10


@pytest.mark.parametrize("value, tables, in_spark, checkpoint", [
    ("auto", None, False, "{data}/checkpoints/inbox_stream"),
    ("auto", "s3://bucket/relay", True, "s3a://bucket/relay/_checkpoints/inbox_stream"),
    ("true", None, True, "{data}/checkpoints/inbox_stream"),
    ("false", "s3://bucket/relay", False, "{data}/checkpoints/inbox_stream"),
])
def test_the_stream_state_goes_to_spark_with_the_tables_on_s3(tmp_path, value, tables, in_spark,
                                                              checkpoint):
    """`stream.state_store = "auto"` (the default): the state store and a checkpoint any host
    takes over from where the tables are shared (S3), the driver's low-latency path on a
    local disk; true and false choose either way."""
    env = {"RELAY_STREAM__STATE_STORE": value, **({"RELAY_TABLES_DIR": tables} if tables else {})}
    s = config.load(None, env=env, data_dir=str(tmp_path))
    assert config.Settings().stream.state_store == "auto"
    assert s.stream_state_in_spark is in_spark
    assert str(s.stream_checkpoint) == checkpoint.format(data=tmp_path.resolve())
