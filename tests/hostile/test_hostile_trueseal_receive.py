"""Hostile load on the trueseal receive (Noise XX on TCP, in egress) listener: 10,000 connections at each
stage (see attacker.py), from one address and from 253, while a legitimate client of every
protocol keeps doing round trips; then nothing acked so far is lost. See relay_under_attack.py for
the rules and the figures written to the results file."""

from __future__ import annotations

import pytest

import scenarios

pytestmark = pytest.mark.hostile
LISTENER = "trueseal_receive"


@pytest.mark.parametrize("stage,addresses", scenarios.params(LISTENER))
def test_hostile_load(relay_under_attack, stage, addresses):
    scenarios.run(relay_under_attack, LISTENER, stage, addresses)


def test_nothing_acked_lost(relay_under_attack):
    scenarios.nothing_acked_lost(relay_under_attack, LISTENER)
