"""`relay bench --control-hosts`: what a control change costs when several hosts share a
control plane (delta_tables/control.py, decision 0009).

Two `HeyaControl`s over one tables directory on local disk (fsync on), as two hosts; per
round, alternating in one process:

- `one_host_ms`: AUTHs on one host, one after another: a fenced commit each;
- `alternating_ms`: AUTHs on the two hosts in turn: every change finds the other host's commit
  since its handle, loses its commit, folds the other's row and commits again (the worst case);
- `miss_ms`: a send token minted on A and looked up on B (`find_send_token`): the refresh a
  SEND of a token made on another host pays once.

Medians per round, and the median over rounds; ratios to `one_host_ms`. -> bench-control-hosts.json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

CHANGES = 60
ROUNDS = 3


async def _round(root: Path) -> dict[str, float]:
    from delta_tables.heya_control import HeyaControl, mint_inbox_tokens
    from delta_tables.layout import Layout

    tables = root / "tables"
    a, b = (HeyaControl(Layout(root / n, tables), fsync=True) for n in ("a", "b"))
    (inbox,) = mint_inbox_tokens(Layout(root / "a", tables), fsync=True)
    await a.load()
    await b.load()
    owner = b"\x07" * 32
    assert await a.inco(owner, inbox)
    await b.refresh()

    async def timed(coro) -> float:
        t0 = time.perf_counter()
        await coro
        return (time.perf_counter() - t0) * 1000

    one = [await timed(a.auth(owner, 0, 2**31)) for _ in range(CHANGES)]
    await b.refresh()
    alternating = [await timed((a if i % 2 else b).auth(owner, 0, 2**31))
                   for i in range(CHANGES)]
    miss = []
    for _ in range(CHANGES // 4):
        tok = await a.auth(owner, 0, 2**31)
        miss.append(await timed(b.find_send_token(tok.token)))
    conflicts = a.conflicts + b.conflicts
    return {"one_host_ms": statistics.median(one),
            "alternating_ms": statistics.median(alternating),
            "miss_ms": statistics.median(miss), "conflicts": conflicts}


def measure() -> dict:
    rounds = []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory(prefix="bench-control-") as d:
            rounds.append(asyncio.run(_round(Path(d))))
    med = {k: statistics.median(r[k] for r in rounds)
           for k in ("one_host_ms", "alternating_ms", "miss_ms")}
    return {"rounds": rounds, "median": med,
            "ratio_alternating": med["alternating_ms"] / med["one_host_ms"],
            "ratio_miss": med["miss_ms"] / med["one_host_ms"],
            "changes_per_round": CHANGES}


def main(args) -> int:
    result = {"section": "control-hosts", **measure()}
    out = Path(args.out or "bench-control-hosts.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench --control-hosts: {out}")
    return 0
