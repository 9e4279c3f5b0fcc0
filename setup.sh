#!/usr/bin/env bash
# Set up everything the relay needs on a fresh Debian machine with Python 3.11:
# Java 17 for Spark (from Debian, only if missing) and a virtualenv with the project.
# Idempotent: a second run only checks. Nothing is downloaded at run time afterwards.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v java >/dev/null 2>&1; then
  echo "setup: installing Java 17 from Debian" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null
fi

if ! command -v mvn >/dev/null 2>&1; then
  echo "setup: installing Maven from Debian (it fetches the Delta and S3 jars once)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq maven >/dev/null
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import relay, pyspark, deltalake, chispa" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.installed
fi
# Bytecode for the relay's own packages, written now: where PYTHONDONTWRITEBYTECODE is set (as
# on this sandbox and many CI images) every process would otherwise compile them again at each
# start, ~0.4 s of a PPP listener's ~1.8 s of imports. Up-to-date files are skipped.
.venv/bin/python -m compileall -q engine ingress egress delta_tables runtime relay jobs >/dev/null
# Spark's Python processes import the installed pyspark instead of compiling its zipped copy
# at each start (jobs/spark_python_path.py: a .pth file in the virtualenv).
.venv/bin/python -m jobs.spark_python_path 2>/dev/null
# The JVM parts pyspark does not ship (delta-spark, delta-storage, hadoop-aws and the AWS SDK
# modules S3A uses), from Maven Central once, into ~/.cache/spark-relay/jars (RELAY_JARS_DIR):
# every SparkSession names them in spark.jars, so nothing is fetched at run time.
.venv/bin/python -m jobs.jars >/dev/null
echo "setup: ready (.venv/bin/relay)" >&2
