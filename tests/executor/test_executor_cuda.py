"""CUDA path: the same transparency checks on a GPU, and NCCL with one process per GPU.

Skipped without CUDA (and the multi-process test without two GPUs). Tolerances are looser than on
CPU because cuBLAS may pick different kernels for different row counts (TF32 is off).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.pipeline import LocalPipeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_in_process_pipeline_on_cuda_matches_unpipelined(checkpoint, schedule):
    torch.backends.cuda.matmul.allow_tf32 = False
    options = {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64}
    config = RunConfig.of(model="transformer", options=options, partition=(2, 2), batch_size=10,
                       microbatches=4, checkpoint=checkpoint, schedule=schedule, device="cuda")
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    model = build_model("transformer", options, 0).cuda()
    ref = pipe.prepared.loss_fn(model(inputs.cuda()), targets.cuda())
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    for (name, p), q in zip(pipe.model().named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_processes(tmp_path):
    report = tmp_path / "r.json"
    result = subprocess.run([sys.executable, "-m", "gpipe.main", "train", "--model", "mlp", "--stages", "2",
                             "--batch", "16", "--microbatches", "4", "--steps", "3", "--device", "cuda",
                             "--schedule", "1f1b", "--report", str(report)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert len(data["losses"]) == 3 and all(s["peak_allocated_bytes"] > 0 for s in data["stages"])
