"""Let Spark's Python processes import the installed pyspark, not its zipped copy.

Spark starts its Python processes (the streaming source runner, the planning daemons,
executors' workers) with `PYTHONPATH=<pyspark>/python/lib/pyspark.zip:<...>/py4j-*-src.zip`
ahead of everything else (PythonWorkerFactory; the order is fixed). Those archives hold
source only, and zipimport never caches bytecode, so every such process compiled pyspark
from source at its start, and kept the heap that compiling grew: the relay's source runner
idled at 67 MiB PSS this way and at 54 importing the same pyspark from site-packages
(issue 20; `relay bench --startup`).

The archives are copies of the package pip installed beside them (the same wheel), so
dropping exactly those two entries from `sys.path` makes `import pyspark` find the same code
with its bytecode. `install()` writes a one-line `.pth` file into the virtualenv's
site-packages (`setup.sh` runs it): Python's `site` executes it at every interpreter start,
after PYTHONPATH is on `sys.path`. The paths are baked in at install time and removed only if
present, so a pyspark upgrade (new archive names) or another environment leaves everything as
Spark set it, and the next `setup.sh` writes the new names.
"""

from __future__ import annotations

import sys
from pathlib import Path

PTH_NAME = "relay-spark-python-path.pth"


def zipped_copies(site_dir: Path) -> list[str]:
    """The archives of the pyspark installed in `site_dir` whose package is installed there
    too (py4j is pyspark's dependency: `py4j-<version>-src.zip` only if that version is)."""
    lib = site_dir / "pyspark" / "python" / "lib"
    out = []
    if (lib / "pyspark.zip").is_file() and (site_dir / "pyspark" / "__init__.py").is_file():
        out.append(str(lib / "pyspark.zip"))
    for archive in sorted(lib.glob("py4j-*-src.zip")):
        version = archive.name[len("py4j-"):-len("-src.zip")]
        if (site_dir / "py4j" / "__init__.py").is_file() and any(
                site_dir.glob(f"py4j-{version}.dist-info")):
            out.append(str(archive))
    return out


def pth_line(paths: list[str]) -> str:
    """The `.pth` line: `site` executes a line that starts with `import`."""
    return (f"import sys; sys.path[:] = [p for p in sys.path if p not in {tuple(paths)!r}]\n")


def install(site_dir: Path) -> Path | None:
    """Write (or refresh) the `.pth` file in `site_dir`; None if there is nothing to drop."""
    target = site_dir / PTH_NAME
    paths = zipped_copies(site_dir)
    if not paths:
        target.unlink(missing_ok=True)
        return None
    line = pth_line(paths)
    if not target.is_file() or target.read_text() != line:
        target.write_text(line)
    return target


def site_dir_of_pyspark() -> Path:
    """Where pip installed pyspark, resolved as pyspark's own find_spark_home resolves it
    (that is the SPARK_HOME whose archives Spark puts on PYTHONPATH). Found, not imported."""
    import importlib.util
    return Path(importlib.util.find_spec("pyspark").origin).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    written = install(site_dir_of_pyspark())
    print(f"spark_python_path: {written or 'nothing to drop'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
