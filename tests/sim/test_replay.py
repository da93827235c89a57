"""``gpipe replay``: the runs file's schema, the error arithmetic, runs not modelled, the dev set."""

import json
import os

import pytest

from gpipe.main import main
from sim.errors import GpipeInputError
from sim.evidence.replay import Replayed, load_runs, replay, summary
from sim.workloads.models import get_workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.path.join(ROOT, "benchmarks", "published_runs", "dev.json")
RUN = {"id": "small", "source": "a test", "hardware": "a100-nvlink", "nodes": 1, "model": "transformer",
       "options": {"layers": 4, "d_model": 256, "ff": 1024, "heads": 8, "seq": 128, "vocab": 1000},
       "tensor_parallel": 2, "pipeline_stages": 2, "replicas": 2, "context_parallel": 1, "virtual_stages": None,
       "microbatch_size": 2, "global_batch": 16, "checkpoint": "full", "sequence_parallel": True,
       "precision": "bf16", "measured_step_s": 0.01, "note": "unknown keys are ignored"}


def resolve(model, options):
    return get_workload(model, options)


def test_the_error_is_predicted_over_measured_less_one():
    done = replay(dict(RUN), resolve)
    assert done.modelled and done.predicted_step_s > 0
    assert done.error == pytest.approx(done.predicted_step_s / 0.01 - 1, rel=1e-12)
    assert done.layout["microbatches"] == 4 and done.layout["tensor_parallel"] == 2  # 16 / D=2 / 2 rows
    assert any(a.startswith("virtual_stages null: ") for a in done.assumed)
    results = [Replayed("a", True, 1.0, 1.1, 0.1), Replayed("b", True, 2.0, 1.5, -0.25), Replayed("c", False, 3.0),
               Replayed("d", True, 1.0, 0.98, -0.02)]
    report = summary(results)
    assert report["median_abs_error"] == pytest.approx(0.1) and report["worst_abs_error"] == pytest.approx(0.25)
    assert [r["id"] for r in report["runs"]] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("change,reason", [
    ({"context_parallel": 2, "attention": "eager"}, "runs ring attention on flash kernels"),
    ({"options": {**RUN["options"], "rope_scaling": "yarn"}}, "unknown option(s) rope_scaling"),
    ({"tensor_parallel": 16}, "spans more than a node"),
    ({"model": "mlp", "options": {}, "checkpoint": "selective", "precision": "bf16-autocast"},
     "--checkpoint selective recomputes"),
])
def test_a_run_that_cannot_be_modelled_is_listed_with_why(change, reason):
    done = replay({**RUN, **change}, resolve)
    assert not done.modelled and done.predicted_step_s is None and reason in done.reason


def test_tensor_and_context_parallelism_over_two_nodes_is_modelled():
    """T = 8 x C = 2 on 8-GPU nodes, as NVIDIA's Llama 3.1 405B recipes run it on H100: TP inside a
    node, the context-parallel ring across two; the run is modelled, not refused."""
    run = {**RUN, "hardware": "h100-nvlink", "nodes": 8, "tensor_parallel": 8, "context_parallel": 2,
           "options": {**RUN["options"], "seq": 256, "attention": "flash"}, "global_batch": 16}
    done = replay(run, resolve)
    assert done.modelled, done.reason
    assert done.layout["tensor_parallel"] == 8 and done.layout["context_parallel"] == 2


def test_an_unstated_microbatch_size_is_the_planners_best():
    done = replay({**RUN, "microbatch_size": None}, resolve)
    assert done.modelled and any(a.startswith("microbatch_size null: ") for a in done.assumed)
    assert done.layout["microbatches"] in (1, 2, 4, 8)


@pytest.mark.parametrize("data,message", [
    ({"nope": []}, "has no \"runs\" list"),
    ({"runs": [{"id": "x"}]}, "run 'x' of"),
    ({"runs": [{**RUN, "measured_step_s": 0}]}, "measured_step_s must be a positive number"),
    ({"runs": [{**RUN, "options": None}]}, "options must be an object"),
])
def test_a_bad_runs_file_is_one_line(tmp_path, data, message):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GpipeInputError, match=message.replace("(", r"\(")):
        load_runs(str(path))


def test_the_development_set_replays(capsys, tmp_path):
    code = main(["replay", DEV, "--json", "--html", str(tmp_path / "r.html")])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    by_id = {r["id"]: r for r in report["runs"]}
    dense = {"korth-22b-full", "korth-22b-selective-sp", "narayanan-1.7b-dp32", "nemotron4-15b-h100",
             "mbridge2511-llama3-8b-b200-fp8cs-8g", "dgxc-llama31-405b-gb200-bf16-128g",
             "tt-70b-256gpu-2D", "tt-old-a100-llama2-13b-noac"}
    experts = {"dgxc-dsv3-h100-nemo2504-bf16-1024g": 64, "dgxc-llama4mav-gb200-nemo2504-bf16-256g": 64,
               "mbridge2604-qwen3-30b-h100-fp8-16g": 16}
    assert set(by_id) == dense | set(experts)
    assert all(run["modelled"] for run in report["runs"])
    assert by_id["nemotron4-15b-h100"]["layout"]["tensor_parallel"] == 4  # kv_heads 8 and squared ReLU modelled
    assert [by_id[i]["layout"]["zero"] for i in ("tt-70b-256gpu-2D", "tt-old-a100-llama2-13b-noac")] == [3, 3]
    assert all(abs(by_id[i]["error"]) < 0.05 for i in dense)  # the dense development set within 5%
    assert {i: by_id[i]["layout"]["expert_parallel"] for i in experts} == experts
    # The goal for the MoE development rows is 7%. Priced with the pipeline split, token dropping, dispatcher and
    # CUDA graphs their sources state and the MoE layers' fixed time fitted on the three, DeepSeek-V3 misses it
    # (-10.0%; docs/simulator.md says why), Llama 4 Maverick (-1.6%) and Qwen3-30B-A3B (+4.0%) meet it: each held
    # within 3 points of its present error, either way, so that none drifts unseen
    present = {"dgxc-dsv3-h100-nemo2504-bf16-1024g": -0.100, "dgxc-llama4mav-gb200-nemo2504-bf16-256g": -0.016,
               "mbridge2604-qwen3-30b-h100-fp8-16g": 0.040}
    assert all(abs(by_id[i]["error"] - error) < 0.03 for i, error in present.items())
    assert by_id["dgxc-dsv3-h100-nemo2504-bf16-1024g"]["layout"]["partition"] == [4] * 16  # 3 + embedding, 4, 2 + MTP + head
    assert report["worst_abs_error"] >= report["median_abs_error"] > 0
    assert (tmp_path / "r.html").stat().st_size > 1000
