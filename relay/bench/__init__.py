"""`relay bench`: the benchmark, a tool beside the relay rather than part of it.

`run.py` runs the sections in order and writes the JSON file; `harness.py` is what they
share; `tables.py` measures delta-rs and the stream alone; `trueseal.py` (with its load
generator `trueseal_client.py`), `heya.py`, `ppp.py` and `sync.py` one protocol each. Only
the CLI imports it, inside the `bench` command (tests/test_layout.py holds it to that).
"""
