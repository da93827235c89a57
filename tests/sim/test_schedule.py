import pytest

from sim.errors import GpipeInputError
from sim.schedules.schedule import (Action, Kind, build_schedule, check_interleaving, default_virtual_stages,
                                    device_of_virtual_stage, format_grid, recomputes, virtual_stages_of_device)


def grid(stages, microbatches, schedule, checkpoint):
    return [" ".join(map(str, actions)) for actions in build_schedule(stages, microbatches, schedule, checkpoint,
                                                                      default_virtual_stages(schedule))]


def test_gpipe_fill_and_drain_literal():
    assert grid(3, 4, "gpipe", "never") == [
        "0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0",
        "1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0",
        "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0",
    ]


def test_gpipe_except_last_recomputes_all_but_the_last_microbatch():
    assert grid(2, 3, "gpipe", "except_last") == [
        "0F0 0F1 0F2 0B2 0R1 0B1 0R0 0B0",
        "1F0 1F1 1F2 1B2 1R1 1B1 1R0 1B0",
    ]


def test_gpipe_always_recomputes_every_microbatch():
    assert grid(1, 2, "gpipe", "always") == ["0F0 0F1 0R1 0B1 0R0 0B0"]


def test_1f1b_literal():
    assert grid(3, 4, "1f1b", "never") == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_1f1b_with_fewer_microbatches_than_stages():
    assert grid(4, 2, "1f1b", "never") == [
        "0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1", "3F0 3B0 3F1 3B1"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "full"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 5), (4, 4), (5, 2)])
def test_every_stage_runs_each_microbatch_once_in_a_valid_order(schedule, checkpoint, stages, microbatches):
    for k, actions in enumerate(build_schedule(stages, microbatches, schedule, checkpoint)):
        assert all(a.stage == k for a in actions)
        for m in range(microbatches):
            kinds = [a.kind for a in actions if a.microbatch == m]
            expected = [Kind.FORWARD] + ([Kind.RECOMPUTE] if recomputes(checkpoint, m, microbatches) else [])
            assert kinds == expected + [Kind.BACKWARD]
            assert actions.index(Action(k, Kind.FORWARD, m)) < actions.index(Action(k, Kind.BACKWARD, m))


def test_action_string_round_trip():
    action = Action(1, Kind.FORWARD, 3)
    assert str(action) == "1F3"
    assert Action.parse("12R7") == Action(12, Kind.RECOMPUTE, 7)
    assert Action.parse("3I0") == Action(3, Kind.INPUT, 0) and str(Action(2, Kind.WEIGHT, 5)) == "2W5"
    with pytest.raises(GpipeInputError, match="bad action"):
        Action.parse("1X3")


def test_grid_printer_highlights_an_action():
    text = format_grid(build_schedule(2, 2, "gpipe", "never"), highlight=Action(1, Kind.BACKWARD, 0))
    assert text.splitlines() == ["stage 0: 0F0 0F1 0B1 0B0", "stage 1: 1F0 1F1 1B1 [1B0]"]


@pytest.mark.parametrize("args,message", [
    ((0, 4, "gpipe", "never"), "stages"),
    ((2, -1, "gpipe", "never"), "micro-batches"),
    ((2, 2, "zigzag", "never"), "unknown schedule 'zigzag'"),
    ((2, 2, "gpipe", "sometimes"), "unknown checkpoint policy 'sometimes'"),
])
def test_bad_arguments_raise_one_line_errors(args, message):
    with pytest.raises(GpipeInputError, match=message):
        build_schedule(*args)



def grid_interleaved(stages, microbatches, virtual, checkpoint="never"):
    return [" ".join(map(str, actions))
            for actions in build_schedule(stages, microbatches, "interleaved", checkpoint, virtual)]


def test_interleaved_literal_two_devices_two_chunks():
    # device 0 holds virtual stages 0 and 2, device 1 holds 1 and 3; micro-batches go in groups of K=2
    assert grid_interleaved(2, 4, 2) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def _list_schedule(per_device, virtual_stages_total, forward_s=1.0, backward_s=2.0, input_s=1.0, weight_s=1.0):
    """Run the lists with each action waiting only for its input (sends free and asynchronous):
    (step time, busy time per device). Fails on a deadlock."""
    durations = {Kind.FORWARD: forward_s, Kind.RECOMPUTE: forward_s, Kind.BACKWARD: backward_s,
                 Kind.INPUT: input_s, Kind.WEIGHT: weight_s}
    done, free_s, position = {}, [0.0] * len(per_device), [0] * len(per_device)
    busy_s = [0.0] * len(per_device)
    progress = True
    while progress:
        progress = False
        for device, actions in enumerate(per_device):
            while position[device] < len(actions):
                action = actions[position[device]]
                needs = None
                if action.kind is Kind.FORWARD and action.stage > 0:
                    needs = (action.stage - 1, Kind.FORWARD, action.microbatch)
                elif action.kind in (Kind.BACKWARD, Kind.INPUT) and action.stage < virtual_stages_total - 1:
                    # the next stage's gradient, from its B or its I (dualpipev mixes the two)
                    needs = next(((action.stage + 1, kind, action.microbatch) for kind in (Kind.BACKWARD, Kind.INPUT)
                                  if (action.stage + 1, kind, action.microbatch) in done), "not yet")
                if needs == "not yet" or (needs is not None and needs not in done):
                    break
                duration = durations[action.kind]
                start = max(free_s[device], done[needs] if needs else 0.0)
                free_s[device] = start + duration
                busy_s[device] += duration
                done[(action.stage, action.kind, action.microbatch)] = free_s[device]
                position[device] += 1
                progress = True
    assert position == [len(a) for a in per_device], "the lists deadlock"
    return max(free_s), busy_s


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("virtual", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 5])
def test_interleaved_runs_every_chunk_once_on_its_device_with_the_formula_bubble(stages, virtual, groups):
    microbatches = groups * stages
    per_device = build_schedule(stages, microbatches, "interleaved", "never", virtual)
    for device, actions in enumerate(per_device):
        assert {a.stage % stages for a in actions} == {device}
        expected = {(c * stages + device, kind, m) for c in range(virtual) for m in range(microbatches)
                    for kind in (Kind.FORWARD, Kind.BACKWARD)}
        assert sorted((a.stage, a.kind, a.microbatch) for a in actions) == sorted(expected)
    step_s, busy_s = _list_schedule(per_device, stages * virtual)
    bubble = sum(step_s - b for b in busy_s) / (stages * step_s)
    assert bubble == pytest.approx((stages - 1) / (virtual * microbatches + stages - 1), abs=1e-12)


def test_interleaved_recomputes_per_chunk_before_each_backward():
    per_device = build_schedule(2, 2, "interleaved", "except_last", 2)
    for actions in per_device:
        for index, action in enumerate(actions):
            if action.kind is Kind.BACKWARD and action.microbatch != 1:
                assert actions[index - 1] == Action(action.stage, Kind.RECOMPUTE, action.microbatch)


@pytest.mark.parametrize("stages, microbatches, virtual, schedule, message", [
    (2, 3, 2, "interleaved", "multiple of stages"),
    (2, 4, 1, "interleaved", "--virtual-stages 2 or more"),
    (2, 4, 2, "1f1b", "needs --schedule interleaved"),
])
def test_interleaved_refusals_are_one_line(stages, microbatches, virtual, schedule, message):
    with pytest.raises(GpipeInputError, match=message) as error:
        build_schedule(stages, microbatches, schedule, "never", virtual)
    assert "\n" not in str(error.value)


def test_more_chunks_than_layers_is_refused():
    with pytest.raises(GpipeInputError, match="6 chunks but the model has 5 layers"):
        check_interleaving(3, 3, 2, num_layers=5)


def test_zb_h1_literal_three_stages():
    grid = format_grid(build_schedule(3, 4, "zb-h1", "never"))
    assert grid.splitlines() == [
        "stage 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "stage 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "stage 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "selective"])
@pytest.mark.parametrize("stages,microbatches", [(1, 3), (2, 5), (4, 4), (4, 8), (5, 2)])
def test_zb_h1_runs_each_microbatch_once_in_order_holding_at_most_k_in_flight(checkpoint, stages, microbatches):
    per_device = build_schedule(stages, microbatches, "zb-h1", checkpoint)
    for k, actions in enumerate(per_device):
        for m in range(microbatches):
            kinds = [a.kind for a in actions if a.microbatch == m]
            again = [Kind.RECOMPUTE] if recomputes(checkpoint, m, microbatches) else []
            assert kinds == [Kind.FORWARD] + again + [Kind.INPUT, Kind.WEIGHT]
        in_flight = peak = 0  # forward done, weight gradients not yet
        for action in actions:
            in_flight += {Kind.FORWARD: 1, Kind.WEIGHT: -1}.get(action.kind, 0)
            peak = max(peak, in_flight)
        assert peak == min(stages, microbatches)  # 1F1B's first stage holds as many
    _list_schedule(per_device, stages)  # no deadlock


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("microbatches_per_stage", [1, 2, 3])
def test_zb_h1_bubble_is_the_paper_formula_on_uniform_costs(stages, microbatches_per_stage):
    microbatches = stages * microbatches_per_stage
    step_s, _ = _list_schedule(build_schedule(stages, microbatches, "zb-h1", "never"), stages,
                               forward_s=1.0, input_s=1.0, weight_s=1.0)
    assert step_s == microbatches * 3.0 + (stages - 1) * (1.0 + 1.0 - 1.0)  # (K-1)(F+I-W) of idle time
    one_f_one_b, _ = _list_schedule(build_schedule(stages, microbatches, "1f1b", "never"), stages,
                                    forward_s=1.0, backward_s=2.0)
    assert one_f_one_b == microbatches * 3.0 + (stages - 1) * 3.0  # (K-1)(F+B)


def test_zb_h1_refuses_per_layer_recompute_in_one_line():
    with pytest.raises(GpipeInputError, match="--checkpoint full") as caught:
        build_schedule(2, 4, "zb-h1", "full")
    assert "\n" not in str(caught.value)


def test_zbv_literal_two_devices():
    """ZB-V (Qi et al. 2024, section 6): device d runs virtual stages d and 2K-1-d; the same order as
    torch's ScheduleZBVZeroBubble (tests/sim/test_torch_schedule.py checks that for K = 1..4)."""
    assert grid(2, 4, "zbv", "never") == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"]


def test_dualpipev_literal_two_devices():
    """DualPipeV: full backwards (B) in the steady state, each paired with the other chunk's forward,
    split into I and W in the drain."""
    assert grid(2, 4, "dualpipev", "never") == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"]


def test_v_placement_puts_the_second_chunk_back_up_the_devices():
    assert [device_of_virtual_stage(s, 3, "zbv") for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [device_of_virtual_stage(s, 3, "interleaved") for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert virtual_stages_of_device(0, 3, 2, "dualpipev") == [0, 5]
    assert virtual_stages_of_device(2, 3, 2, "interleaved") == [2, 5]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "selective"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_v_schedules_run_each_chunk_once_on_its_device_without_deadlock(schedule, checkpoint, stages, extra):
    """Every (virtual stage, micro-batch) once: F, the recompute its policy asks for, then B or I and
    W; on the device the V places it; and the lists finish when each action waits only for its input.
    ZB-V also with fewer micro-batches than its 2K-1 warm-up (its counts are cut back)."""
    microbatches = (2 * stages if schedule == "dualpipev" else max(1, stages - 1)) + extra
    per_device = build_schedule(stages, microbatches, schedule, checkpoint, 2)
    for device, actions in enumerate(per_device):
        assert {device_of_virtual_stage(a.stage, stages, schedule) for a in actions} == {device}
        for s in virtual_stages_of_device(device, stages, 2, schedule):
            for m in range(microbatches):
                kinds = [a.kind for a in actions if (a.stage, a.microbatch) == (s, m)]
                again = [Kind.RECOMPUTE] if recomputes(checkpoint, m, microbatches) else []
                assert kinds in ([Kind.FORWARD, *again, Kind.BACKWARD],
                                 [Kind.FORWARD, *again, Kind.INPUT, Kind.WEIGHT]), (device, s, m, kinds)
    _list_schedule(per_device, 2 * stages)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("microbatches_per_device", [2, 3, 5])
def test_v_schedules_idle_k_minus_one_chunk_forwards_on_uniform_costs(schedule, stages, microbatches_per_device):
    """With F = I = W per chunk (B = I + W), each device computes 6M and the step is 6M + (K-1)F:
    the only idle time is the first forward's way down the V, against zb-h1's (K-1)(F+I-W) in
    stage-sized actions (twice these chunks') and 1F1B's (K-1)(F+B)."""
    microbatches = stages * microbatches_per_device
    step_s, busy_s = _list_schedule(build_schedule(stages, microbatches, schedule, "never", 2), 2 * stages,
                                    forward_s=1.0, backward_s=2.0, input_s=1.0, weight_s=1.0)
    assert busy_s == [6.0 * microbatches] * stages
    assert step_s == 6.0 * microbatches + (stages - 1) * 1.0


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (3, 6), (4, 8), (4, 12)])
def test_zbv_holds_what_1f1b_holds(stages, microbatches):
    """ZB-V's selling point: at most 2K chunk-sized micro-batches in flight per device (forward done,
    W not yet), what 1F1B's first stage holds in stage-sized ones (K)."""
    for actions in build_schedule(stages, microbatches, "zbv", "never", 2):
        in_flight = peak = 0
        for action in actions:
            in_flight += {Kind.FORWARD: 1, Kind.WEIGHT: -1}.get(action.kind, 0)
            peak = max(peak, in_flight)
        assert peak <= 2 * stages


@pytest.mark.parametrize("schedule, stages, microbatches, virtual, message", [
    ("zbv", 2, 4, 1, "--schedule zbv runs two chunks per device in a V; use --virtual-stages 2, not 1"),
    ("dualpipev", 2, 4, 3, "use --virtual-stages 2, not 3"),
    ("dualpipev", 3, 5, 2, "--schedule dualpipev needs at least 2K = 6 micro-batches with K=3 stages, got M=5"),
])
def test_v_schedule_refusals_are_one_line(schedule, stages, microbatches, virtual, message):
    with pytest.raises(GpipeInputError, match=None) as error:
        build_schedule(stages, microbatches, schedule, "never", virtual)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_refuse_per_layer_recompute(schedule):
    with pytest.raises(GpipeInputError, match="--checkpoint full"):
        build_schedule(2, 4, schedule, "full", 2)


def test_the_bubble_figure_orders_the_schedules_as_their_formulas(tmp_path, capsys):
    """The docs' and the notebook's figure: 1F1B at (K-1)/(M+K-1), ZB-H1 below it, ZB-V and
    DualPipeV below ZB-H1 (only the first forward's way down the V: (K-1) chunk forwards of 1 ms
    against a device's 6M ms of work), dualpipev only from M = 2K; and the script that writes its
    table (benchmarks/schedule_bubbles.py, as docs/training.md runs it)."""
    import json

    from benchmarks.schedule_bubbles import main as write_table
    from sim.views.figures import schedules_bubble_figure
    from sim.schedules.schedule_bubbles import schedule_bubbles

    points = {(p.schedule, p.microbatches): p for p in schedule_bubbles(4, (4, 8, 16))}
    for m in (4, 8, 16):
        assert points[("1f1b", m)].bubble_fraction == pytest.approx(3 / (m + 3))
        assert points[("zbv", m)].bubble_fraction < points[("zb-h1", m)].bubble_fraction < points[("1f1b", m)].bubble_fraction
    for m in (8, 16):
        assert points[("zbv", m)].step_time_s == pytest.approx((6 * m + 3) * 1e-3)
        assert points[("dualpipev", m)].bubble_fraction == pytest.approx(points[("zbv", m)].bubble_fraction)
    assert ("dualpipev", 4) not in points
    figure = schedules_bubble_figure(list(points.values()), 4)
    assert [trace.name for trace in figure.data] == ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]
    assert write_table(["--out", str(tmp_path / "bubbles.json")]) == 0
    written = {(p["schedule"], p["microbatches"]): p["bubble_fraction"]
               for p in json.loads((tmp_path / "bubbles.json").read_text())["points"]}
    assert written[("zbv", 8)] == pytest.approx(points[("zbv", 8)].bubble_fraction)
    assert "zbv         M=4:  20.0%" in capsys.readouterr().out


def test_only_the_first_action_of_a_devices_step_starts_cold():
    """The step's first action follows the optimizer and the executor's work between steps; an
    action after another kind (1F1B's forward after a backward) or another chunk does not start cold."""
    from sim.schedules.schedule import cold_starts

    actions = [Action.parse(text) for text in ("0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0R0", "0B0")]
    assert cold_starts(actions) == [True] + [False] * 8
    assert cold_starts([]) == []
