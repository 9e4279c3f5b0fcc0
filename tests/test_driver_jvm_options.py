"""The driver JVM gives idle memory back (jobs/spark_session.py): the shared session's real
JVM reports the options in force, and a JDK without the native heap trimmer still starts; it
compiles with C1 only unless `stream.jvm_options` says otherwise."""

from __future__ import annotations

import os
import stat

from pyspark import SparkContext

from jobs.spark_session import (NATIVE_TRIM_INTERVAL_MS, driver_java_options,
                                native_trim_options, stream_jvm_options)


def vm_option(name: str) -> str:
    jvm = SparkContext._gateway.jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    return bean.getVMOption(name).getValue()


def java_version(spark) -> tuple[int, ...]:
    text = SparkContext._gateway.jvm.java.lang.System.getProperty("java.version")
    return tuple(int(p) for p in text.split("-")[0].split("+")[0].split(".")[:3])


def test_driver_jvm_returns_idle_heap_and_native_memory(spark):
    assert vm_option("G1PeriodicGCInterval") == "30000"
    assert vm_option("MaxHeapFreeRatio") == "30"
    assert vm_option("ExplicitGCInvokesConcurrent") == "true"   # the cleaner's System.gc()
    version = java_version(spark)
    has_trimmer = version >= (22,) or (21, 0, 1) <= version < (22,) or (17, 0, 9) <= version < (18,)
    if has_trimmer:
        assert native_trim_options(), f"JDK {version} has the trimmer, the probe missed it"
        assert vm_option("TrimNativeHeapInterval") == str(NATIVE_TRIM_INTERVAL_MS)
    else:
        assert native_trim_options() == ()


def test_a_jvm_without_the_trimmer_gets_no_trim_option(tmp_path):
    """A `java` that refuses the option (as JDK 17.0.8 does: "Unrecognized VM option") and
    one that is missing: no option, so the driver JVM starts as before."""
    old = tmp_path / "java"
    old.write_text("#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in -XX:*TrimNative*) "
                   "echo 'Unrecognized VM option' >&2; exit 1;; esac; done\nexit 0\n")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    assert native_trim_options(str(old)) == ()
    assert native_trim_options(os.fspath(tmp_path / "absent")) == ()


def test_driver_jvm_compiles_with_c1_only_unless_the_conf_says_otherwise(spark):
    assert vm_option("TieredStopAtLevel") == "1"
    assert int(vm_option("ReservedCodeCacheSize")) == 240 << 20   # not C1's client-size 48 MiB
    # stream.jvm_options come last, and HotSpot takes the last of a repeated flag
    opts = driver_java_options("relay", "-XX:TieredStopAtLevel=4").split()
    levels = [o for o in opts if o.startswith("-XX:TieredStopAtLevel=")]
    assert levels == ["-XX:TieredStopAtLevel=1", "-XX:TieredStopAtLevel=4"]


def test_the_stateful_stream_compiles_with_c2_and_the_conf_still_wins():
    """With its state in the state store the stream's JVM runs the processor's hot loop: the
    full JIT, after C1's flag so it wins; `stream.jvm_options` after both."""
    opts = driver_java_options("relay", stream_jvm_options(True, "-XX:TieredStopAtLevel=1"))
    levels = [o for o in opts.split() if o.startswith("-XX:TieredStopAtLevel=")]
    assert levels == ["-XX:TieredStopAtLevel=1", "-XX:TieredStopAtLevel=4",
                      "-XX:TieredStopAtLevel=1"]
    assert stream_jvm_options(False, "") == ""
    assert stream_jvm_options(True, "") == "-XX:TieredStopAtLevel=4"
