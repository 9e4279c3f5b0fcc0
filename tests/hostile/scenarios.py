"""What every listener module of the suite runs: each stage of its protocol (attacker.STAGES)
from one source address and spread over 253, then the check that nothing acked was lost."""

from __future__ import annotations

import pytest

from attacker import STAGES
from relay_under_attack import MANY_ADDRESSES, ONE_ADDRESS


def params(listener: str) -> list:
    return [pytest.param(stage, addresses, id=f"{stage}-{name}")
            for stage in STAGES[listener]
            for name, addresses in (("one_address", ONE_ADDRESS),
                                    ("many_addresses", MANY_ADDRESSES))]


def run(relay_under_attack, listener: str, stage: str, addresses: list[str]) -> None:
    figures, broken = relay_under_attack.attack(listener, stage, addresses)
    if "attacker" not in figures:
        pytest.fail("; ".join(broken))
    a = figures["attacker"]
    print(f"\n{listener} {stage} {figures['addresses']}: "
          f"{a['established']} of {a['attempted']} at the stage, relay held "
          f"{figures['relay_sockets_peak']} at most, ramp {figures['ramp_s']} s; "
          f"rss {figures['rss_before_mib']} -> {figures['rss_peak_mib']} -> "
          f"{figures['rss_after_mib']} MiB; log {figures['log_lines_per_s']} lines/s; legit "
          + ", ".join(f"{p} {f['p50_s']}/{f['max_s']} s ({f['failures']} failed)"
                      for p, f in figures["legit"].items()))
    assert not broken, "; ".join(broken)


def nothing_acked_lost(relay_under_attack, listener: str) -> None:
    out = relay_under_attack.acked_lost(listener)
    print(f"\nacked and not lost: {out}")
    lost = {p: r for p, r in out.items() if r.get("missing") != 0}
    assert not lost, f"acked messages lost or not checkable: {lost}"
