"""``--checkpoint selective_op``: torchtitan's op-level selective activation checkpointing, priced.

Its policy saves the outputs of the ops on its save list (``aten.mm``, the flash attention kernels,
the reduce-scatter) but every second matmul's, and reruns the rest of a block's forward inside the
backward: in a Llama block's order q, k, v, o, w1, w3, w2 the block keeps its input and q, v, w1 and
w2's outputs, the flash kernel's output and log-sum-exp, and reruns k, o, w3 and every elementwise op;
fp8's scaled matmuls are not on the list, so all of them rerun. Checked here by hand on one block, against
``never`` and ``full`` on a whole model, and where it is refused: not flash, a mixture of experts, the
planner's search and ``gpipe train`` (one line each).
"""

from __future__ import annotations

import json

import pytest

from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from sim.workloads.models import get_workload
from sim.workloads.moe.workload import builtin_workload
from sim.workloads.transformer import transformer_layers
from sim.workloads.model_options import resolve_options
from sim.workloads.workload import check_checkpoint_for
from tests.helpers.in_process import gpipe

# a Llama-shaped block: gated MLP, grouped keys and values, flash attention, bf16 weights and activations
LLAMA = {"layers": 2, "d_model": 64, "ff": 96, "heads": 4, "kv_heads": 2, "seq": 16, "vocab": 128,
         "activation": "swiglu", "attention": "flash", "precision": "bf16-model"}


def _block(**changes):
    return transformer_layers(resolve_options("transformer", {**LLAMA, **changes}))[1]


def test_the_block_keeps_its_input_the_odd_matmuls_outputs_and_the_flash_kernels():
    s, d, f, h, dq, e, c, F = 16, 64, 96, 4, 64, 32, 2, 2  # bf16-model: the stream in bf16 too
    block = _block()
    assert block.op_checkpointed
    assert block.op_recompute_flops_per_row == pytest.approx(2.0 * s * (d * e + dq * d + d * f))  # k, o, w3
    kept = s * d * F + s * (dq + e + f) * c + s * d * c + s * dq * c + h * s * 4  # input, q v w1, w2, out, lse
    assert block.op_kept_bytes_per_row == pytest.approx(kept)
    assert block.op_kept_bytes_per_row < block.saved_bytes_per_row


def test_fp8_reruns_every_projection_and_keeps_none_of_their_outputs():
    bf16, fp8 = _block(), _block(precision="fp8")
    projections = fp8.flops_per_row - fp8.attention_flops_per_row
    assert fp8.op_recompute_flops_per_row == pytest.approx(projections)
    assert fp8.op_kept_bytes_per_row < bf16.op_kept_bytes_per_row


def test_it_prices_between_never_and_full_on_a_gpu():
    system = get_system("h100-nvlink")
    workload = get_workload("transformer", {**LLAMA, "layers": 4, "d_model": 1024, "ff": 3584, "heads": 16,
                                            "kv_heads": 4, "seq": 2048})
    op = workload.layer_costs(2, system.device)[1]
    assert 0 < op.op_recompute_s < op.recompute_s  # part of the forward rerun, not all of it
    assert 0 < op.op_dropped_bytes < op.saved_bytes
    step = {}
    for checkpoint in ("never", "selective_op", "full"):
        result = gpipe("simulate", "--model", "transformer", *[f"--option={k}={v}" for k, v in {
            **LLAMA, "layers": 4, "d_model": 1024, "ff": 3584, "heads": 16, "kv_heads": 4, "seq": 2048}.items()],
            "--hardware", "h100-nvlink", "--batch", "8", "--microbatches", "4", "--stages", "2",
            "--checkpoint", checkpoint, "--json")
        assert result.returncode == 0, result.stderr
        step[checkpoint] = json.loads(result.stdout)
    times = {k: v["step_time_s"] for k, v in step.items()}
    peaks = {k: max(s["peak_activation_bytes"] for s in v["stages"]) for k, v in step.items()}
    assert times["never"] < times["selective_op"] < times["full"]
    assert peaks["full"] < peaks["selective_op"] < peaks["never"]


def test_it_is_refused_in_one_line_where_it_is_not_priced_or_not_trained():
    with pytest.raises(GpipeInputError, match="selective_op .* attention=flash"):
        check_checkpoint_for(get_workload("transformer", {**LLAMA, "attention": "eager"}), "selective_op")
    moe = builtin_workload("transformer", {**LLAMA, "attention": "flash", "experts": 4, "top_k": 2})
    with pytest.raises(GpipeInputError, match="selective_op"):
        check_checkpoint_for(moe, "selective_op")
    planned = gpipe("plan", "--model", "transformer", "--checkpoints", "never,selective_op", "--batch", "8")
    assert planned.returncode == 2 and "--checkpoints selective_op: priced by gpipe simulate" in planned.stderr
    trained = gpipe("train", "--model", "transformer", "--checkpoint", "selective_op", "--steps", "1")
    assert trained.returncode == 2 and "selective_op (torchtitan's op-level policy)" in trained.stderr
    for result in (planned, trained):
        assert len(result.stderr.strip().splitlines()) == 1
