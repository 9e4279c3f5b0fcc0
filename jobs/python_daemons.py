"""Stop the Python daemons Spark started for a query's start once the query runs.

Spark forks its Python workers from a daemon per worker module (`python -m pyspark.daemon
<module>`) and keeps each daemon for the life of the JVM. Starting the inbox stream uses
three modules once each: `lookup_data_sources` (the session's lookup of Python data sources),
`create_data_source` (the `landing` source's instance) and `plan_data_source_read` (the read
function, a lazy value of Spark's PythonMicroBatchStream: computed in the first batch, kept
for the query's life). Their daemons then idle for good, ~37 MiB of PSS apiece, an eighth of
the relay's idle memory (issue 20; `relay bench --startup`). The steady work uses the source
runner (not a daemon's child) and, for a batch too big for the driver to read, `pyspark.worker`
(executors' read tasks), whose daemon is not touched.

How: `PythonWorkerFactory.stop()` on those modules' factories, once the first batch has
committed (so none of them has a worker at work). It is what Spark calls when its
environment stops: it closes the idle workers and stops the daemon, and the factory starts a
new daemon if the module is ever asked for again (a query restarted in the same session):
if the list below is wrong, one daemon start is paid, nothing breaks. The factories sit in a
private map of `SparkEnv`, reached by Java reflection over Py4J; if a Spark release changes
that, the stream logs it and runs on with the daemons.
"""

from __future__ import annotations

import logging

log = logging.getLogger("relay.stream")

# Worker modules a running query does not use again (pyspark/sql/worker/*.py).
QUERY_START_MODULES = ("pyspark.sql.worker.lookup_data_sources",
                       "pyspark.sql.worker.create_data_source",
                       "pyspark.sql.worker.plan_data_source_read")


def _factories(spark) -> list:
    """(worker module, PythonWorkerFactory) of every factory the driver's SparkEnv holds.

    Through the field, not the accessor: Py4J resolving a method of SparkEnv (or
    `getDeclaredMethod`) loads every type its methods name, and one of them is a protobuf
    class pyspark does not ship (NoClassDefFoundError). Fields name only a map."""
    gw = spark.sparkContext._gateway
    env = spark.sparkContext._jsc.sc().env()
    field = gw.jvm.java.lang.Class.forName("org.apache.spark.SparkEnv") \
        .getDeclaredField("pythonWorkers")
    field.setAccessible(True)
    workers = field.get(env)                    # mutable.HashMap[PythonWorkersKey, factory]
    out = []
    keys = workers.keysIterator()
    while keys.hasNext():
        key = keys.next()
        out.append((str(key.workerModule()), workers.apply(key)))
    return out


def retire_query_start_daemons(spark, modules=QUERY_START_MODULES) -> list[str]:
    """Stop the daemons of `modules` (call once the query has run a batch). Returns the
    modules whose daemons were stopped."""
    try:
        stopped = []
        for module, factory in _factories(spark):
            if module in modules:
                factory.stop()
                stopped.append(module)
    except Exception as exc:        # Py4J errors are plain Exceptions: Spark changed inside
        log.warning("left Spark's query-start Python daemons running: %s", exc,
                    extra={"event": "python_daemons_kept"})
        return []
    if stopped:
        log.info("stopped Spark's query-start Python daemons",
                 extra={"event": "python_daemons_stopped", "modules": stopped})
    return stopped
