"""The benchmark's compute bound and critical-path breakdown on a timeline worked out by hand."""

import pytest

from benchmarks.critical_path import analyse


def _record(stage, kind, microbatch, start, end, step=1):
    return {"stage": stage, "kind": kind, "microbatch": microbatch, "start_s": start, "end_s": end, "step": step}


def test_gpipe_two_stages_bound_and_breakdown():
    # K = 2, M = 2, GPipe: F takes 1 s, B 2 s, the optimizer 0.3 s; every hand-off between devices
    # costs 0.5 s, every gap between actions on a device 0.1 s, and the step starts 0.2 s after the
    # previous one ended (at 0). Stage 0's first send takes 0.1 s of the first hand-off.
    records = [
        _record(0, "optimizer", -1, -0.3, 0.0, step=0),
        _record(0, "F", 0, 0.2, 1.2), _record(0, "send_act", 0, 1.2, 1.3), _record(0, "F", 1, 1.3, 2.3),
        _record(1, "F", 0, 1.7, 2.7), _record(1, "F", 1, 2.8, 3.8),
        _record(1, "B", 1, 3.9, 5.9), _record(1, "B", 0, 6.0, 8.0), _record(1, "optimizer", -1, 8.0, 8.3),
        _record(0, "B", 1, 6.4, 8.4), _record(0, "B", 0, 8.5, 10.5), _record(0, "optimizer", -1, 10.5, 10.8),
    ]
    report = {"timeline": {"records": records, "meta": {"partition": [2, 2], "microbatches": 2,
                                                         "schedule": "gpipe", "checkpoint": "never"}},
              "config": {"virtual_stages": 1}}
    step = analyse(report, warmup=1)["steps"][0]
    assert step["step_s"] == pytest.approx(10.8)
    # free hand-offs: device 1 ends at 7, device 0's backwards at 5-7 and 7-9, then 0.3 s of optimizer
    assert step["compute_bound_s"] == pytest.approx(9.3)
    assert step["compute"] == pytest.approx(9.0)  # 0F0 1F0 1F1 1B1 0B1 0B0
    assert step["send"] == pytest.approx(0.1)  # 0F0's send span, on the path
    assert step["handoff"] == pytest.approx(0.9)  # 0F0 -> 1F0 (less its send) and 1B1 -> 0B1
    assert step["between_actions"] == pytest.approx(0.3)
    assert step["between_steps"] == pytest.approx(0.2)
    assert step["optimizer_and_end"] == pytest.approx(0.3)
    assert step["overhead"] == pytest.approx((10.8 - 9.3) / 10.8)
