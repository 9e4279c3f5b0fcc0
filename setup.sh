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
echo "setup: ready (.venv/bin/relay)" >&2
