"""docs/scale-out.md is the scale model's own output (relay/scale_model.py), not a copy that can
drift; and the model's arithmetic does what the document says."""

from pathlib import Path

from relay.scale_model import Inputs, inputs_table, model, report

DOC = (Path(__file__).resolve().parents[1] / "docs" / "scale-out.md").read_text()


def test_the_document_prints_the_model():
    assert inputs_table() in DOC
    assert report() in DOC
    assert report(Inputs(landing_commit_every_ms=250)) in DOC


def test_waiting_longer_between_landing_commits_trades_requests_for_ack_latency():
    back_to_back, grouped = model(), model(Inputs(landing_commit_every_ms=250))
    assert grouped["S3 requests USD/day"] < back_to_back["S3 requests USD/day"]
    assert grouped["ack latency on S3, p50 (ms)"] > back_to_back["ack latency on S3, p50 (ms)"]
    assert grouped["rows per landing commit at peak"] > back_to_back[
        "rows per landing commit at peak"]
    twice = model(Inputs(messages_per_day=200_000_000))
    assert twice["peak messages/s"] == 2 * back_to_back["peak messages/s"]
    assert twice["ingress nodes (2 cores, 70 %, +1)"] >= back_to_back[
        "ingress nodes (2 cores, 70 %, +1)"]
