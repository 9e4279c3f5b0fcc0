"""Both notebooks, executed headless against a synthetic day from the load generator.

CI runs these (`.ci/run`: `pytest -m notebooks`); they are not in the default suite because
each notebook starts its own Spark session (a second JVM next to the suite's). A cell error
fails the test (nbclient raises CellExecutionError); every figure a notebook promises must be
a PNG with content; no output may show a mailbox key. The executed notebooks and the figures
are left in pytest's tmp directory for a look.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CAPACITY_FIGURES = ["cap_traffic_per_hour", "cap_inbox_depth", "cap_latency", "cap_padding",
                    "cap_ttl_vs_delivery", "cap_storage", "cap_storage_ratio",
                    "cap_mailbox_skew", "cap_rooms", "cap_push"]
OPERATIONS_FIGURES = ["ops_stream_progress", "ops_rejects_padding", "ops_compaction"]
SCALE = 0.25          # ~5,000 pushes: enough for every plot, quick on 2 cores
CELL_TIMEOUT = 300


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    from jobs.loadgen import generate_day
    from runtime import config
    data = tmp_path_factory.mktemp("nb") / "day"
    settings = config.load(None, env={}, data_dir=str(data))
    t0 = time.monotonic()
    report = generate_day(settings, scale=SCALE, seed=11)
    print(f"load generator: {time.monotonic() - t0:.1f} s\n{report.format()}")
    assert report.inbox_rows > 0 and report.acks > 0
    assert set(report.rejected) == {"duplicate", "expired"}
    return data


def mailbox_hex(data: Path) -> set[str]:
    """Hex of every mailbox key in the tables (and its first 16 digits, for truncated prints)."""
    from deltalake import DeltaTable
    keys = set()
    for t in ("inbox", "acks", "rejects"):
        keys.update(DeltaTable(str(data / "tables" / t)).to_pyarrow_table(
            columns=["mailbox"]).column("mailbox").to_pylist())
    return {k.hex() for k in keys} | {k.hex()[:16] for k in keys}


def run_notebook(name: str, data: Path, out: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    monkeypatch.setenv("RELAY_NOTEBOOK_DATA_DIR", str(data))
    monkeypatch.setenv("RELAY_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.monotonic()
    try:
        client.execute()      # raises CellExecutionError on the first failing cell
    finally:
        nbformat.write(nb, out / f"{name}.executed.ipynb")
    print(f"{name}: {time.monotonic() - t0:.1f} s")
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            parts.append(o.get("text", ""))
            for mime, value in o.get("data", {}).items():
                if mime.startswith("text/"):
                    parts.append(value if isinstance(value, str) else "".join(value))
            parts.extend(o.get("traceback", []))
    return "\n".join(parts)


def check_figures(out: Path, names: list[str]) -> None:
    import matplotlib.image as mpimg
    for name in names:
        png = out / f"{name}.png"
        assert png.exists(), f"{name}.png was not saved"
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        pixels = mpimg.imread(png)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 500, (name, pixels.shape)
        assert pixels[..., :3].std() > 0.05, f"{name}.png is blank"


def test_capacity_notebook(day, tmp_path, monkeypatch):
    nb = run_notebook("capacity", day, tmp_path, monkeypatch)
    check_figures(tmp_path, CAPACITY_FIGURES)
    images = sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in
                 o.get("data", {}))
    assert images >= len(CAPACITY_FIGURES)          # shown inline too, not only saved
    text = outputs_text(nb)
    assert "no binary column in any view" in text
    # the storage ratio of the data directory, and of the recorded loadgen --retain runs
    assert re.search(r"this data directory: .* storage ratio \d+\.\d\dx", text)
    assert re.search(r"relay loadgen --retain \d{4}-\d\d-\d\d: \d+ pushes, storage ratio "
                     r"\d+\.\d\dx -> \d+\.\d\dx", text)
    assert "mailboxes per UTC day" in text and re.search(r"\d{4}-\d\d-\d\d  ppp\s+\d+ "
                                                         r"mailboxes", text)
    assert re.search(r"\d+ rooms \(\d+ active as of .*\), 0 groups; [1-9]\d* room messages "
                     r"in [1-9]\d* coarse cells", text), "the rooms section found no rooms"
    assert re.search(r"[1-9]\d* wake-ups recorded", text), "the push section found no wake-ups"
    leaked = [k for k in mailbox_hex(day) if k in text]
    assert not leaked, "a mailbox key appears in the notebook's output"


def test_operations_notebook(day, tmp_path, monkeypatch):
    # after the capacity notebook: this one compacts the directory and adds live traffic
    before = mailbox_hex(day)
    nb = run_notebook("operations", day, tmp_path, monkeypatch)
    check_figures(tmp_path, OPERATIONS_FIGURES)
    text = outputs_text(nb)
    assert "caught up: True" in text
    assert "acked envelopes tombstoned" in text
    assert "every landed row is in inbox or rejects exactly once: live True, replay True" in text
    assert "replay False" not in text and "live False" not in text
    assert list(tmp_path.glob("replay-*/tables/inbox/_delta_log"))
    leaked = [k for k in before | mailbox_hex(day) if k in text]
    assert not leaked, "a mailbox key appears in the notebook's output"
    # the stream, the listener and Spark were stopped: no JVM of the notebook is left
    assert "stream stopped after" in text
