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


# Out until fixed (docs/results/2026-12-02-hostile-sync-iroh.md, three runs on 2026-12-02; every
# legitimate round trip was served in all of them). Remove an entry to run it again.
OUT = {
    # The ingress keeps native memory of iroh's side after a wave of idle connections (no
    # Python object is left; malloc_trim and MALLOC_ARENA_MAX=2 do not return it): +12.7%
    # after 2,061 from 253 addresses, +37.8% after 2,283 from one (bound +10%).
    "idle_handshake-one_address": "iroh's native memory after idle connections",
    "idle_handshake-many_addresses": "iroh's native memory after idle connections",
    # The aioquic client's round trip in the same ingress, as 2,300 HELLO'd iroh connections
    # from 253 addresses leave: 1.49 s against 1.40 allowed, in both attempts of one run of
    # three, and in one attempt of the other two.
    "idle_auth-many_addresses": "latency at the attacker's leave",
    # The same native memory after HELLO'd idle connections from one address: +51% (288.1 ->
    # 436.5 MiB) in a run of the whole suite on the merged code, every round trip served.
    "idle_auth-one_address": "iroh's native memory after idle connections",
}


def _params() -> list:
    return [p for p in scenarios.params(LISTENER) if p.id not in OUT]


@pytest.mark.parametrize("stage,addresses", _params())
def test_hostile_load(relay_under_attack, stage, addresses):
    scenarios.run(relay_under_attack, LISTENER, stage, addresses)


def test_nothing_acked_lost(relay_under_attack):
    scenarios.nothing_acked_lost(relay_under_attack, LISTENER)
