from executor.runtime.report import build_report, step_times_s
from sim.formats.timeline import Record, Timeline


def timeline():
    records = []
    for step, base in ((0, 0.0), (1, 1.0), (2, 1.5)):
        records += [Record(0, "F", 0, base, base + 0.1, step), Record(1, "F", 0, base + 0.1, base + 0.2, step),
                    Record(1, "B", 0, base + 0.2, base + 0.4, step), Record(0, "recv_wait", 0, base + 0.1,
                                                                            base + 0.4, step),
                    Record(0, "B", 0, base + 0.4, base + 0.6, step)]
    return Timeline(records=records, source="measured")


def test_step_times_run_from_the_previous_steps_end():
    times = step_times_s(timeline())
    assert times[0] == 0.6
    assert abs(times[1] - 1.0) < 1e-12 and abs(times[2] - 0.5) < 1e-12


def test_report_fields():
    config = {"batch_size": 4, "microbatches": 1, "partition": [1, 1], "warmup_steps": 1}
    report = build_report(timeline(), [1.0, 0.9, 0.8], config, {"partition": [1, 1]}, [10, 20])
    assert abs(report["step_time_s"] - 0.75) < 1e-12  # median of steps 1 and 2
    assert report["losses"] == [1.0, 0.9, 0.8]
    assert [s["peak_activation_bytes"] for s in report["stages"]] == [10, 20]
    assert [round(s["busy_s"], 9) for s in report["stages"]] == [0.3, 0.3]
    assert {(a["stage"], a["kind"]) for a in report["actions"]} == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
