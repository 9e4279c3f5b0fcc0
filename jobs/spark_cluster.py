"""`relay spark master|worker`: a Spark standalone cluster from the installed pyspark.

The pip package of pyspark carries the whole runtime (`bin/spark-class` and every jar), so a
cluster needs no download: the master and each worker are `spark-class` daemons of this
virtualenv, and `relay stream --master spark://host:7077` runs the inbox stream's driver
against them (its executors read landing files and run Python workers there).

Secure by default. A standalone master runs whatever an application sends it, as this user,
so the cluster only admits drivers that know the relay's Spark secret (`spark.authenticate`,
a 32-byte key in `<data>/keys/spark_secret`, created on first use; copy the file to each host
of the cluster, mode 0600). The daemons read it from `_SPARK_AUTH_SECRET` in their
environment (only this user can read a process's environment); the driver gets it over Py4J
once its JVM is up (jobs/spark_session.py), so it is never on a command line that `ps` shows.
The REST submission server (port 6066, no authentication) is off; the web UIs bind to the
daemon's host address, loopback by default.

Every host runs the same interpreter path and sees the same data directory (executors open
landing files by path): one machine, or a shared file system mounted at the same place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from runtime import keys

SECRET_FILE = "spark_secret"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# Both daemons: authenticate every connection; no unauthenticated REST job submission.
DAEMON_OPTS = "-Dspark.authenticate=true -Dspark.master.rest.enabled=false"


def is_standalone(master: str) -> bool:
    return master.startswith("spark://")


def spark_home() -> Path:
    import pyspark
    return Path(pyspark.__file__).resolve().parent


def secret(data_dir: str | os.PathLike) -> str:
    """The cluster's shared secret (hex), created on first use."""
    return keys.load_or_create(data_dir, SECRET_FILE).private_bytes.hex()


def daemon(kind: str, args: list[str], *, host: str, data_dir: str | os.PathLike
           ) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a master or worker daemon."""
    home = spark_home()
    env = dict(os.environ, SPARK_HOME=str(home), SPARK_LOCAL_IP=host,
               PYSPARK_PYTHON=sys.executable, _SPARK_AUTH_SECRET=secret(data_dir))
    opts_var = "SPARK_MASTER_OPTS" if kind == "master" else "SPARK_WORKER_OPTS"
    env[opts_var] = f"{env.get(opts_var, '')} {DAEMON_OPTS}".strip()
    cls = MASTER_CLASS if kind == "master" else WORKER_CLASS
    return [str(home / "bin" / "spark-class"), cls, "--host", host, *args], env


def master_command(*, host: str, port: int, webui_port: int, data_dir
                   ) -> tuple[list[str], dict[str, str]]:
    return daemon("master", ["--port", str(port), "--webui-port", str(webui_port)],
                  host=host, data_dir=data_dir)


def worker_command(master: str, *, host: str, cores: int, memory: str, webui_port: int,
                   work_dir: str | os.PathLike, data_dir) -> tuple[list[str], dict[str, str]]:
    return daemon("worker", ["--cores", str(cores), "--memory", memory,
                             "--webui-port", str(webui_port), "--work-dir", str(work_dir),
                             master], host=host, data_dir=data_dir)


def run(command: tuple[list[str], dict[str, str]]) -> None:
    """Become the daemon: its signals, exit status and logs are this process's."""
    argv, env = command
    os.execve(argv[0], argv, env)
