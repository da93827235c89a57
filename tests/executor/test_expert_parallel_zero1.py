"""ZeRO-1 with expert parallelism (``gpipe train --expert-parallel E --zero 1``, gloo, torchrun) against
one process.

D = 4 replicas in groups of E = 2: the non-expert parameters' optimizer state sharded over all four,
each routed expert's over the D/E = 2 replicas holding it (:mod:`executor.parallel.expert_zero`). Held
as tests/executor/test_expert_parallel.py holds expert parallelism without sharding (losses, the
routers' auxiliary losses and gradient norms rtol 1e-5, every parameter from the consolidated
checkpoint at atol 1e-4), AdamW with clipping. Three launches (four with the resume) share the matrix (slow: multi-process):
one stage, top-2 with SwiGLU, whose per-rank optimizer-state bytes the simulator predicts (this model's
parameter sizes split evenly by torch's whole-parameter partition) and whose checkpoint resumes at
E = 1, ZeRO-1, on the same partition; two stages, top-1 with a shared expert, three steps; and one
stage at D = E = 2, where each rank steps its own experts whole.
"""

import shutil

import pytest

from tests.helpers.expert_runs import assert_bytes_as_simulated, assert_trains_as_one_process, reference, train
from tests.helpers.moe_parity import MOE

STATE_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")


@pytest.mark.slow
def test_zero1_with_experts_sharded_over_their_own_replicas_trains_as_one_process_and_resumes_at_one(tmp_path):
    """K = 1, D = 4, E = 2, ZeRO-1, top-2 without shared experts, SwiGLU: two steps train as one
    process; each rank's optimizer state is its quarter of the non-expert parameters' and its half of
    its experts', as the simulator predicts; the consolidated checkpoint resumes at E = 1 (ZeRO-1,
    D = 4, the same partition) for the third step."""
    options = {**MOE, "top_k": 2, "shared_experts": 0, "activation": "swiglu"}
    common = ["--stages", "1", "--replicas", "4", "--zero", "1", "--batch", "16", "--microbatches", "2",
              "--schedule", "1f1b"]
    report, root = train(tmp_path, "ep", options, *common, "--expert-parallel", "2", "--steps", "2",
                         "--save-every", "2")
    assert_trains_as_one_process(report, root, 1, reference(options, 16, 4, 2, 2), 2)
    assert len(report["ranks"]) == 4
    assert_bytes_as_simulated(report, options, [*common, "--nodes", "4", "--expert-parallel", "2"], STATE_FIELDS)
    # below a whole replica's: 2 x (parameters) of AdamW's moments, sharded
    assert all(entry["optimizer_state_bytes"] < 2 * entry["parameter_bytes"] for entry in report["ranks"])
    shutil.copytree(root, tmp_path / "resumed")
    resumed, _ = train(tmp_path, "resumed", options, *common, "--steps", "3", "--resume", "--save-every", "3")
    assert_trains_as_one_process(resumed, tmp_path / "resumed", 1, reference(options, 16, 4, 2, 3), 3)


@pytest.mark.slow
@pytest.mark.parametrize("replicas,partition", [(4, "2,2"), (2, "4")], ids=["two-stages-d4", "one-stage-e-equals-d"])
def test_zero1_with_experts_sharded_over_their_own_replicas_trains_as_one_process(tmp_path, replicas, partition):
    """E = 2, ZeRO-1, 1F1B, top-1 with a shared expert, GELU: on two stages at D = 4 (the experts' state
    over two replicas each) and on one at D = E = 2 (edp one rank: each rank steps its own experts
    whole, the rest sharded over both), three steps train as one process."""
    options = {**MOE, "top_k": 1, "shared_experts": 1, "activation": "gelu"}
    stages = len(partition.split(","))
    report, root = train(tmp_path, "ep", options, "--stages", str(stages), "--partition", partition, "--replicas",
                         str(replicas), "--expert-parallel", "2", "--zero", "1", "--batch", "16", "--microbatches",
                         "2", "--schedule", "1f1b", "--steps", "3", "--save-every", "3")
    assert_trains_as_one_process(report, root, stages, reference(options, 16, replicas, 2, 3), 3)
