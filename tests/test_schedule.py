import pytest

from sim.errors import GpipeInputError
from sim.schedule import Action, Kind, build_schedule, format_grid, recomputes


def grid(stages, microbatches, schedule, checkpoint):
    return [" ".join(map(str, actions)) for actions in build_schedule(stages, microbatches, schedule, checkpoint)]


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
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
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
