"""The README's five-minute tour, run as written: its shell blocks (after `relay up`, before the
notebook) go to bash one by one against a real `relay up` on free ports and a temporary data
directory, in a directory that has the repository's virtualenv and examples where the README
expects them. The notebook step is what `pytest -m notebooks` runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from relay_up_process import RelayUp

ROOT = Path(__file__).resolve().parents[1]


def tour_blocks() -> list[str]:
    """The bash blocks of the README's tour, in order."""
    text = (ROOT / "README.md").read_text()
    tour = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", tour, flags=re.S)


def test_the_readme_tour_runs_as_written(tmp_path):
    blocks = tour_blocks()
    assert blocks[0].strip() == "./setup.sh && .venv/bin/relay up"
    assert "loadgen" in blocks[-1]
    steps = blocks[1:-1]   # keys, PPP, trueseal, Heya, cursor-sync, watch
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))
    (work / "examples").symlink_to(ROOT / "examples")
    relay = RelayUp(tmp_path / "data", RELAY_TRIGGER_INTERVAL_MS="100")
    ppp_metrics = relay.metrics_ports["ingress-ppp"]
    out = []
    try:
        relay.start()
        relay.ready(timeout=240)
        for block in steps:
            block = block.replace("127.0.0.1:9706", f"127.0.0.1:{ppp_metrics}")
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work,
                                 env=relay.env, capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, f"{block}\n{run.stdout}\n{run.stderr}"
            out.append(run.stdout)
    finally:
        relay.kill()
    keys, ppp, trueseal, heya, sync, watch = out
    assert re.search(r"^trueseal [0-9a-f]{64}$", keys, re.M)
    assert '"message": "hello bob"' in ppp and '"verified": true' in ppp \
        and '"acked": true' in ppp
    assert "push acked: True" in trueseal and "same bytes: True" in trueseal
    assert "GIVE seq 0: 'hello over Heya'" in heya
    assert "PULL [(1, 'hello over cursor-sync')]" in sync
    assert re.search(r"^  ppp +1 +0 ", watch, re.M) and re.search(r"^  sync +1 +1 ", watch, re.M)
    assert 'relay_ingress_accepted_total{protocol="ppp"} 1.0' in watch
