"""What every listener module of the suite runs: each stage of its protocol (attacker.STAGES)
from one source address and spread over 253, then the check that nothing acked was lost.

One rule is judged twice: a scenario whose only miss is a legitimate round trip slower than
its bound is run once more, and passes only if that second attack is within every rule.
Whole runs on this 2-core machine (the attacker, Spark and every role on the same cores) miss
at most one of 57 scenarios by latency, a different one each time, by 0.1-0.8 s at a
transition (the ramp's end, the attacker leaving); a relay that locks clients out misses both
attacks. Both
attempts are kept in the results file (`attempt`) and the table, so a retry stays visible.
A failed or lost round trip, memory, the log and the relay's life are never retried."""

from __future__ import annotations

import pytest

from attacker import STAGES
from relay_under_attack import MANY_ADDRESSES, ONE_ADDRESS, only_slower


def params(listener: str) -> list:
    return [pytest.param(stage, addresses, id=f"{stage}-{name}")
            for stage in STAGES[listener]
            for name, addresses in (("one_address", ONE_ADDRESS),
                                    ("many_addresses", MANY_ADDRESSES))]


def run(relay_under_attack, listener: str, stage: str, addresses: list[str],
        **options) -> None:
    """One scenario; `options` go to `RelayUnderAttack.attack` (count, identity, ...)."""
    figures, broken = relay_under_attack.attack(listener, stage, addresses, **options)
    what = " ".join([listener, stage, figures["addresses"]]
                    + [str(options[k]) for k in ("identity", "count") if k in options])
    if only_slower(broken):
        print(f"\n{what}: attempt 1 missed ({'; '.join(broken)}); attempt 2")
        figures, broken = relay_under_attack.attack(listener, stage, addresses, attempt=2,
                                                    **options)
    if "attacker" not in figures:
        pytest.fail("; ".join(broken))
    a = figures["attacker"]
    print(f"\n{what}: "
          f"{a['established']} of {a['attempted']} at the stage, relay held "
          f"{figures['relay_sockets_peak']} at most, ramp {figures['ramp_s']} s; "
          f"rss {figures['rss_before_mib']} -> {figures['rss_peak_mib']} -> "
          f"{figures['rss_after_mib']} MiB; log {figures['log_lines_per_s']} lines/s; legit "
          + ", ".join(f"{p} {f['p50_s']}/{f['max_s']} s ({f['failures']} failed)"
                      for p, f in figures["legit"].items())
          + f"; admission {figures.get('admission')}")
    assert not broken, "; ".join(broken)


def nothing_acked_lost(relay_under_attack, listener: str) -> None:
    out = relay_under_attack.acked_lost(listener)
    print(f"\nacked and not lost: {out}")
    lost = {p: r for p, r in out.items() if r.get("missing") != 0}
    assert not lost, f"acked messages lost or not checkable: {lost}"
