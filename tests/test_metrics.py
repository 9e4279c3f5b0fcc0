"""The /metrics endpoints during real traffic: counters move exactly as the traffic does
(tests/traffic_run.py drives ingress, the stream and egress and scrapes each endpoint)."""

from traffic_run import GOOD_1, GOOD_2, OVERSIZE, RETRIES, SHORT


def test_ingress_counters_follow_pushes(traffic):
    c = traffic.checks
    assert c["accepted_0"] == 0
    assert c["accepted_1"] == GOOD_1
    assert c["commit_rows_1"] == GOOD_1
    assert c["commit_hist_count_1"] == c["commits_1"] >= 1
    assert c["sessions_during"] == 1 and c["sessions_after"] == 0
    # admission slots by stage: the push session is anonymous (UNAUTH after NK)
    assert c["held_during"] == {"handshake": 0, "unauth": 1, "auth": 0}
    assert c["held_after"] == {"handshake": 0, "unauth": 0, "auth": 0}
    assert c["accepted_2"] == GOOD_1 + GOOD_2 + RETRIES
    assert c["rejected_2"] == {"oversize": OVERSIZE, "short_body": SHORT}
    assert c["commit_rows_2"] == GOOD_1 + GOOD_2 + RETRIES


def test_stream_counters_and_landing_lag(traffic):
    c = traffic.checks
    assert c["lag_before"] >= 1 and c["lag_seconds_before"] > 0
    assert c["stream_rows"] == GOOD_1 + GOOD_2 + RETRIES
    assert c["stream_accepted"] == GOOD_1 + GOOD_2
    assert c["stream_rejected"] == {"duplicate": RETRIES}
    assert c["stream_hist_count"] == c["stream_batches"] >= 1
    assert c["lag_after"] == 0 and c["lag_seconds_after"] == 0


def test_egress_counters_follow_deliveries(traffic):
    c = traffic.checks
    assert c["role"] == 1
    assert c["pending_0"] == GOOD_1 + GOOD_2
    assert c["delivered"] == c["acked"] == c["ack_commit_rows"] == c["want_a"]
    assert c["pending_1"] == GOOD_1 + GOOD_2 - c["want_a"]
    assert c["receive_sessions"] == 1
    assert c["receive_held"] == {"handshake": 0, "unauth": 0, "auth": 1}   # after XX
