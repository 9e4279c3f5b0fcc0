"""Fixtures of the hostile-load suite (`pytest -m hostile`): one results file and one
`relay up` for the whole run, shared by every listener's scenarios (starting it and measuring
the legitimate clients' baseline costs ~45 s; each attack is judged against the state just
before it, and a relay an attack broke fails the attacks after it too)."""

from __future__ import annotations

import pytest

from relay_under_attack import RESULTS, RelayUnderAttack, Results


@pytest.fixture(scope="session")
def relay_under_attack(tmp_path_factory):
    results = Results(RESULTS)
    r = RelayUnderAttack(tmp_path_factory.mktemp("hostile"), results)
    try:
        r.start()
        yield r
    finally:
        r.stop()
        results.save()
