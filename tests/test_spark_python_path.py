"""Spark's Python processes import the installed pyspark, not the zipped copy Spark puts first
on their PYTHONPATH (jobs/spark_python_path.py): the `.pth` line in a real interpreter, and the
worker of the shared session's real JVM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jobs.spark_python_path import PTH_NAME, install, site_dir_of_pyspark, zipped_copies

REAL_SITE = site_dir_of_pyspark()


def fake_site(tmp_path: Path, py4j_version: str | None = None) -> Path:
    """A site dir holding links to the real pyspark, py4j and py4j's dist-info (optionally
    under another version, as after an upgrade of one of them)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pyspark").symlink_to(REAL_SITE / "pyspark")
    (site / "py4j").symlink_to(REAL_SITE / "py4j")
    info = next(REAL_SITE.glob("py4j-*.dist-info"))
    name = info.name if py4j_version is None else f"py4j-{py4j_version}.dist-info"
    (site / name).symlink_to(info)
    return site


def run_isolated(site: Path, code: str) -> str:
    """`code` in an interpreter without the virtualenv's site-packages (-S), with Spark's
    PYTHONPATH for `site`'s archives, after `site.addsitedir(site)` (which runs its .pth)."""
    lib = site / "pyspark" / "python" / "lib"
    archives = [str(lib / "pyspark.zip"), *map(str, sorted(lib.glob("py4j-*-src.zip")))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(archives)}
    prog = f"import site, sys; site.addsitedir({str(site)!r}); {code}"
    return subprocess.run([sys.executable, "-S", "-c", prog], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


def test_the_pth_line_makes_spark_pythonpath_find_the_installed_packages(tmp_path):
    site = fake_site(tmp_path)
    show = "import pyspark, py4j; print(pyspark.__file__); print(py4j.__file__)"
    # without the file: Spark's PYTHONPATH wins, both come from the zipped copies
    before = run_isolated(site, show).splitlines()
    assert all(".zip" + os.sep in f for f in before), before
    written = install(site)
    assert written == site / PTH_NAME
    after = run_isolated(site, show).splitlines()
    assert after == [str(site / "pyspark" / "__init__.py"), str(site / "py4j" / "__init__.py")]
    # the same code: the archive's module list matches the package's
    assert run_isolated(site, "import pyspark; print(pyspark.__version__)") == \
        subprocess.run([sys.executable, "-c", "import pyspark; print(pyspark.__version__)"],
                       capture_output=True, text=True, check=True).stdout.strip()


def test_py4j_archive_stays_when_another_py4j_is_installed(tmp_path):
    site = fake_site(tmp_path, py4j_version="0.0.1")
    assert zipped_copies(site) == [str(site / "pyspark" / "python" / "lib" / "pyspark.zip")]
    install(site)
    out = run_isolated(site, "import py4j; print(py4j.__file__)")
    assert ".zip" + os.sep in out        # the archive's py4j, as Spark set it


def test_install_is_idempotent_and_removes_a_stale_file(tmp_path):
    site = fake_site(tmp_path)
    first = install(site).read_text()
    assert install(site).read_text() == first
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / PTH_NAME).write_text("import sys\n")
    assert install(empty) is None and not (empty / PTH_NAME).exists()


def test_spark_workers_of_this_environment_import_the_installed_pyspark(spark):
    """setup.sh installs the file; a worker forked by Spark's real daemon reports where its
    pyspark came from."""
    assert (REAL_SITE / PTH_NAME).is_file(), "run ./setup.sh (jobs/spark_python_path.py)"
    files = spark.sparkContext.parallelize([0], 1).map(
        lambda _: (__import__("pyspark").__file__, __import__("py4j").__file__)).collect()
    assert files == [(str(REAL_SITE / "pyspark" / "__init__.py"),
                      str(REAL_SITE / "py4j" / "__init__.py"))]
