"""ZB-V and DualPipeV (two chunks per device in a V) compute exactly what the unpipelined model computes.

Device d holds virtual stages d and 2K-1-d, so the hand-off between the chunks (virtual stages K-1
and K) stays in the process of device K-1 and device 0 holds the first and the last stage. One step
of the in-process pipeline is compared with one plain forward and backward of the whole model for K
in {1, 2, 4}, the re-materialization policies the split backward takes, M from below ZB-V's 2K-1
warm-up to above it (DualPipeV needs 2K), on uneven micro-batches (batch 2M-1). Tied weights (the
embedding and the head, both on device 0), several tensors between chunks, bf16 and AdamW with
clipping are checked the same way; tolerances as in ``test_transparency.py`` (losses rtol 1e-6,
gradients rtol 1e-5, atol 1e-6; several AdamW steps as :func:`check_adamw_steps`).

The multi-process test (``slow``) trains K = 2 over torchrun with each schedule and compares losses
and gradient norms with the in-process pipeline (rtol 1e-6), and the recorded timeline with the V's
placement. D = 2 replicas of a ZB-V pipeline are in ``test_executor_replicas.py``.
"""

import json

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.in_process import gpipe
from tests.helpers.parity import (CLIP, OPTIONS, SEVERAL, TIED, check_adamw_steps, check_bf16_step, check_step,
                                  check_tied_step)

V_SCHEDULES = ("zbv", "dualpipev")
PARTITIONS = {("mlp", 1): (3, 5), ("mlp", 2): (2, 2, 2, 2), ("mlp", 4): (1,) * 8,
              ("transformer", 1): (1, 3), ("transformer", 2): (1, 1, 1, 1)}


def microbatch_options(schedule, stages):
    return (2 * stages, 2 * stages + 1) if schedule == "dualpipev" else sorted({1, 2 * stages - 1, 2 * stages + 1})


GRID = [(schedule, model, stages, m, policy) for schedule in V_SCHEDULES for (model, stages) in PARTITIONS
        for m in microbatch_options(schedule, stages) for policy in ("always", "except_last", "never")
        if (policy == "never" or m > 1) and (model == "mlp" or policy != "except_last")]
GRID += [(schedule, "transformer", 2, 4, "selective") for schedule in V_SCHEDULES]


def v_config(schedule, model, stages, microbatches, checkpoint="never", **overrides):
    return RunConfig.of(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)],
                     batch_size=max(3, 2 * microbatches - 1), microbatches=microbatches, checkpoint=checkpoint,
                     schedule=schedule, virtual_stages=2, **overrides)


@pytest.mark.parametrize("schedule,model,stages,microbatches,checkpoint", GRID)
def test_one_step_matches_unpipelined(schedule, model, stages, microbatches, checkpoint):
    check_step(v_config(schedule, model, stages, microbatches, checkpoint))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_each_device_holds_the_two_arms_of_the_v(schedule):
    pipe = LocalPipeline(v_config(schedule, "mlp", 4, 8))
    assert [[chunk.config.stage for chunk in device.chunks] for device in pipe.devices] == [[0, 7], [1, 6], [2, 5],
                                                                                           [3, 4]]
    assert [device.is_first for device in pipe.devices] == [True, False, False, False]
    assert [device.is_last for device in pipe.devices] == [True, False, False, False]


@pytest.mark.parametrize("schedule,stages,partition", [
    *[(s, k, p) for s in V_SCHEDULES for k, p in [(1, (2, 2)), (2, (1, 1, 1, 1))]],
    ("zb-h1", 2, (2, 2)),  # one chunk per device: the embedding on device 0, the head on device 1
])
def test_tied_weights_match_unpipelined_under_the_split_backward(schedule, stages, partition):
    """The embedding (virtual stage 0) and the head (the last) share a weight: in a V both on device 0,
    under zb-h1 on the first and the last device, each copy's gradient summed after its W."""
    config = RunConfig.of(model=TIED, data="tests.helpers.sample_models:tied_lm_data", loss="cross_entropy",
                       partition=partition, batch_size=11, microbatches=2 * stages + 1, checkpoint="except_last",
                       schedule=schedule, virtual_stages=len(partition) // stages)
    check_tied_step(LocalPipeline(config))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages,partition", [(2, (1, 2, 1, 2)), (3, (1,) * 6)])
def test_several_tensors_cross_the_v_and_its_turn(schedule, stages, partition):
    check_step(RunConfig.of(model=SEVERAL, partition=partition, batch_size=2 * stages * 2 - 1,
                         microbatches=2 * stages, checkpoint="always", loss="mse", schedule=schedule,
                         virtual_stages=2))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_bf16_step_matches_unpipelined_under_autocast(schedule):
    config = v_config(schedule, "transformer", 2, 4, "except_last", precision="bf16")
    config.batch_size = 10  # the bf16 check's batch: 3,3,3,1
    check_bf16_step(config)


@pytest.mark.parametrize("schedule,model", [("zbv", "transformer"), ("dualpipev", "mlp")])
def test_adamw_with_clipping_and_cosine_matches_unpipelined(schedule, model):
    config = v_config(schedule, model, 2, 5, "always", optimizer="adamw", lr=0.01, weight_decay=0.1,
                      clip_grad_norm=CLIP[model] / 2, lr_schedule="cosine", lr_warmup_steps=1, steps=5)
    check_adamw_steps(config)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev"])  # zbv over torchrun: tests/executor/test_executor_replicas.py (D = 2)
def test_two_processes_in_a_v_match_in_process(tmp_path, schedule):
    """K = 2 over torchrun: the in-process pipeline's losses and norms; each rank's timeline names the
    virtual stages of its arms of the V, and the report lists their layers. DualPipeV: full backwards
    (B) and split ones (I, W) in one step, across two processes."""
    run = ["--model", "mlp", "--option", "width=32", "--batch", "9", "--microbatches", "5", "--stages", "2",
           "--partition", "1,3,2,2", "--schedule", schedule, "--checkpoint", "except_last", "--optimizer", "adam",
           "--clip-grad-norm", "0.05", "--steps", "3"]
    result = gpipe("train", *run, "--report", str(tmp_path / "run.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "run.json").read_text())
    config = RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(1, 3, 2, 2), batch_size=9, microbatches=5,
                       checkpoint="except_last", schedule=schedule, virtual_stages=2, optimizer="adam",
                       clip_grad_norm=0.05, steps=3)
    pipe = LocalPipeline(config)
    expected = [pipe.run_step(s) for s in range(3)]
    assert data["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert data["grad_norms"] == pytest.approx(pipe.grad_norms, rel=1e-6)
    assert [s["chunk_layers"] for s in data["stages"]] == [[1, 2], [3, 2]]
    records = data["timeline"]["records"]
    assert {(r["stage"], r["virtual_stage"]) for r in records if r["kind"] == "F"} == {(0, 0), (1, 1), (1, 2), (0, 3)}
    kinds = {r["kind"] for r in records}
    assert {"I", "W"} <= kinds and ("B" in kinds) == (schedule == "dualpipev")


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (3, 6), (4, 8), (4, 13)])
def test_the_simulated_peak_is_the_count_of_microbatches_in_flight(schedule, stages, microbatches):
    """On identical layers (one per chunk, checkpoint never) each device's predicted peak activation
    memory is one layer's activations times the most chunk micro-batches it holds between a forward
    and the end of its backward (B, or W)."""
    from sim.engine.engine import simulate
    from sim.formats.layout import ParallelLayout
    from sim.catalog.hardware import get_system
    from sim.schedules.schedule import Kind, build_schedule
    from sim.workloads.workload import UniformWorkload

    workload = UniformWorkload(2 * stages)
    result = simulate(workload, get_system("ideal"), [1] * (2 * stages), microbatches,
                      ParallelLayout.for_partition([1] * (2 * stages), microbatches, checkpoint="never",
                                                   schedule=schedule, virtual_stages=2))
    saved = workload.layer_costs(1, get_system("ideal").device)[0].saved_bytes
    for device, actions in enumerate(build_schedule(stages, microbatches, schedule, "never", 2)):
        held = peak = 0
        for action in actions:
            held += {Kind.FORWARD: 1, Kind.WEIGHT: -1, Kind.BACKWARD: -1}.get(action.kind, 0)
            peak = max(peak, held)
        stage = next(s for s in result.stages if s.stage == device)
        assert stage.peak_activation_bytes == peak * saved, (device, peak)


@pytest.mark.parametrize("argv,message", [
    (["train", "--model", "mlp", "--stages", "2", "--schedule", "zbv", "--virtual-stages", "3"],
     "gpipe: error: --schedule zbv runs two chunks per device in a V; use --virtual-stages 2, not 3"),
    (["train", "--model", "mlp", "--stages", "2", "--schedule", "dualpipev", "--batch", "8", "--microbatches", "3"],
     "gpipe: error: --schedule dualpipev needs at least 2K = 4 micro-batches with K=2 stages, got M=3; "
     "use --microbatches 4 or more"),
    (["simulate", "--model", "uniform", "--layers", "8", "--stages", "2", "--schedule", "zbv", "--checkpoint", "full"],
     "gpipe: error: --schedule zbv splits each backward into input and weight gradients, which --checkpoint full"),
    (["plan", "--model", "uniform", "--layers", "8", "--schedules", "zbv", "--stages-options", "8", "--hardware",
      "v100-nvlink"], "gpipe: error: no candidate to search: --schedules zbv cannot run any K of 8 on 8 layers"),
])
def test_bad_v_schedules_are_one_line_and_exit_2(argv, message, capsys):
    from gpipe.main import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
