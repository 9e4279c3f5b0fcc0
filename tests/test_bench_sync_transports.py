"""`relay bench --sync-transports`'s parts that need no Spark: the iroh bindings' cost per call
measured on real endpoints (every byte read back across the bindings), and the summary's
medians, ratios and floor from rounds as the bench writes them."""

from __future__ import annotations

from relay.bench import sync_transports as st


def test_crossing_reads_every_byte_across_the_bindings():
    out = st.crossing(300)
    assert out["calls"] == 299
    assert out["cpu_us_per_call"] > 0 and out["wall_us_per_call"] >= out["cpu_us_per_call"] / 4
    assert 0 < out["loop_thread_cpu_us_per_call"] <= out["cpu_us_per_call"] * 1.5


def _req(rps, ms, main, other):
    return {"requests_per_s": rps, "cpu_cores": {"relay_ms_per_request": ms},
            "relay_ms_per_request_by_thread": {"main_thread": main, "other_threads": other}}


def _push(rps, p50):
    return {"pushes_per_s": rps, "push_to_ack_ms": {"p50": p50}}


def test_summary_medians_ratios_and_floor():
    rounds = [{"crossing": {"cpu_us_per_call": c, "loop_thread_cpu_us_per_call": c,
                            "plain_await_cpu_us": 0.4},
               "requests": {"quic": _req(q, 0.2, 0.2, 0.0), "iroh": _req(i, 0.4, 0.3, 0.1)},
               "pushes": {"quic": _push(q / 2, 100), "iroh": _push(i / 2, 200)}}
              for c, q, i in ((30, 1000, 500), (40, 800, 600), (50, 1200, 300))]
    s = st.summary(rounds)
    assert s["requests_per_s_quic"] == 1000 and s["requests_per_s_iroh"] == 500
    # the ratio is taken per round (0.5, 0.75, 0.25), then its median
    assert s["requests_ratio_iroh_to_quic"] == 0.5
    assert s["push_acks_per_s_iroh"] == 250 and s["push_ack_p50_ms_iroh"] == 200
    assert s["relay_ms_per_request_by_thread_iroh"] == {"main_thread": 0.3,
                                                        "other_threads": 0.1}
    # 4 crossings of 40 us: 0.16 ms a request, 6,250 a second on one core
    assert s["binding_floor_ms_per_request"] == 0.16
    assert s["binding_floor_requests_per_s_per_core"] == 6250
