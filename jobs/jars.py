"""The JVM jars Spark needs beyond pyspark's own: Delta Lake (delta-spark, delta-storage) and S3
(hadoop-aws with the AWS SDK it was built against).

Fetched once, by `setup.sh` (`python -m jobs.jars`), from Maven Central into a local cache;
every SparkSession then names the cached files in `spark.jars`, so nothing is downloaded at run
time (no `spark.jars.packages`, whose Ivy resolution would reach the network at every start).

The versions are not spelled twice: delta-spark's comes from the installed `delta-spark` PyPI
package (pinned in pyproject.toml beside pyspark), the Spark line of its artifact from the
installed pyspark, and hadoop-aws's from the Hadoop client jars that pyspark ships (hadoop-aws
must match them exactly); the AWS SDK version is whatever that hadoop-aws declares.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

SCALA = "2.13"
# The AWS SDK's `bundle` (hadoop-aws's declared dependency) is ~600 MB of every AWS service;
# S3A needs S3, the transfer manager and STS (assumed roles), whose jars Maven resolves with
# their own dependencies (~10 MB).
AWS_SDK_MODULES = ("s3", "s3-transfer-manager", "sts")


def cache_dir() -> Path:
    """`RELAY_JARS_DIR`, else `~/.cache/spark-relay/jars`; one folder per version set."""
    root = os.environ.get("RELAY_JARS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "spark-relay", "jars")
    return Path(root) / f"spark-{spark_version()}_delta-{delta_version()}_hadoop-{hadoop_version()}"


def spark_version() -> str:
    return metadata.version("pyspark")


def delta_version() -> str:
    return metadata.version("delta-spark")


@functools.lru_cache(maxsize=None)
def hadoop_version() -> str:
    """The Hadoop client pyspark was built with (its `hadoop-client-api-<v>.jar`)."""
    import pyspark
    jars = Path(pyspark.__file__).parent / "jars"
    for jar in jars.glob("hadoop-client-api-*.jar"):
        return re.match(r"hadoop-client-api-(.+)\.jar", jar.name).group(1)
    raise RuntimeError(f"no hadoop-client-api jar under {jars}")


def coordinates() -> list[tuple[str, str, str]]:
    spark_line = ".".join(spark_version().split(".")[:2])
    return [("io.delta", f"delta-spark_{spark_line}_{SCALA}", delta_version()),
            ("io.delta", "delta-storage", delta_version()),
            ("org.apache.hadoop", "hadoop-aws", hadoop_version())]


def _pom(sdk_version: str | None) -> str:
    """The jars' pom: with `sdk_version`, hadoop-aws without the SDK `bundle` and the S3
    modules of that version instead; without, hadoop-aws as it declares itself."""
    deps = []
    for group, artifact, version in coordinates():
        exclusions = ""
        if artifact == "hadoop-aws" and sdk_version:
            exclusions = ("<exclusions><exclusion><groupId>software.amazon.awssdk</groupId>"
                          "<artifactId>bundle</artifactId></exclusion></exclusions>")
        deps.append(f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
                    f"<version>{version}</version>{exclusions}</dependency>")
    if sdk_version:
        deps += [f"<dependency><groupId>software.amazon.awssdk</groupId><artifactId>{m}"
                 f"</artifactId><version>{sdk_version}</version></dependency>"
                 for m in AWS_SDK_MODULES]
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>spark-relay</groupId><artifactId>jars</artifactId><version>1</version>
  <dependencies>{''.join(deps)}</dependencies>
</project>"""


def _mvn(pom_dir: Path, *goal: str) -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("mvn not found: set-up needs Maven to fetch the Delta and S3 jars")
    out = subprocess.run([mvn, "-q", "-B", "-f", str(pom_dir / "pom.xml"), *goal],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"mvn {' '.join(goal)} failed:\n{out.stdout[-4000:]}{out.stderr[-2000:]}")
    return out.stdout


def _sdk_version(work: Path) -> str:
    """The AWS SDK version hadoop-aws declares (its `bundle` dependency)."""
    (work / "pom.xml").write_text(_pom(None))
    listing = work / "deps.txt"
    _mvn(work, "dependency:tree", "-Dincludes=software.amazon.awssdk:bundle",
         f"-DoutputFile={listing}")
    m = re.search(r"software\.amazon\.awssdk:bundle:jar:([\w.\-]+)", listing.read_text())
    if not m:
        raise RuntimeError("hadoop-aws declares no software.amazon.awssdk:bundle version")
    return m.group(1)


def fetch(target: Path | None = None) -> Path:
    """Resolve and copy the jars into `target` (default `cache_dir()`); a no-op when the
    folder is complete. Maven keeps its own copy in ~/.m2 too."""
    target = target or cache_dir()
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sdk = _sdk_version(work)
        (work / "pom.xml").write_text(_pom(sdk))
        staging = work / "jars"
        _mvn(work, "dependency:copy-dependencies", "-DincludeScope=runtime",
             f"-DoutputDirectory={staging}")
        target.mkdir(parents=True, exist_ok=True)
        for jar in staging.glob("*.jar"):
            shutil.copy2(jar, target / jar.name)
    (target / ".complete").write_text("\n".join(":".join(c) for c in coordinates()) + "\n")
    return target


def spark_jars() -> list[str]:
    """The cached jars for `spark.jars`, minus what pyspark already ships (Delta's and the
    SDK's transitive dependencies include jars Spark has in another version)."""
    folder = cache_dir()
    if not (folder / ".complete").exists():
        raise RuntimeError(f"Delta and S3 jars missing from {folder}: run ./setup.sh "
                           "(it fetches them once)")
    import pyspark
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    return sorted(str(j) for j in folder.glob("*.jar")
                  if _artifact(j.name) not in shipped) + [str(relay_jar())]


JVM_SOURCES = Path(__file__).parent / "jvm"


def relay_jar() -> Path:
    """The relay's own JVM classes (`jobs/jvm/`: the stream's stateful processor, the local file
    system without .crc files), compiled against pyspark's jars into the cache, once per source
    and Spark version (the name carries a hash of both); `javac` is local, nothing is fetched.
    Built by set-up, and here again if the sources changed since."""
    sources = sorted(JVM_SOURCES.rglob("*.java"))
    digest = hashlib.sha256(spark_version().encode())
    for src in sources:
        digest.update(src.relative_to(JVM_SOURCES).as_posix().encode() + src.read_bytes())
    jar = cache_dir().parent / f"relay-jvm-{digest.hexdigest()[:16]}.jar"
    if jar.exists():
        return jar
    import pyspark
    classpath = str(Path(pyspark.__file__).parent / "jars" / "*")
    jar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["javac", "-nowarn", "-source", "17", "-target", "17", "-cp",
                              classpath, "-d", tmp, *map(str, sources)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"javac failed on jobs/jvm: {out.stderr.strip()[-2000:]}")
        staged = Path(tmp) / "relay.jar"
        subprocess.run(["jar", "cf", str(staged), "-C", tmp, "relay"], check=True)
        os.replace(staged, jar)   # atomic: a concurrent start sees no half-written jar
    return jar


def _artifact(jar_name: str) -> str:
    """`hadoop-aws-3.4.2.jar` -> `hadoop-aws` (the name without its version)."""
    return re.sub(r"-\d[\w.\-]*\.jar$", "", jar_name)


if __name__ == "__main__":
    try:
        print(fetch())
        print(relay_jar())
    except RuntimeError as exc:
        print(f"setup: {exc}", file=sys.stderr)
        sys.exit(1)
