"""``gpipe replay`` on a runs file of the cases a published run leaves unsaid or names in the trainers'
words: every null searched within the stated layout and named with the value chosen, ``attention``
and ``compile`` at the top of a run, ``bf16`` as the trainers mean it; a run without a key of the
schema refuses the file in one line."""

from __future__ import annotations

import json

import pytest

from gpipe.main import main
from tests.helpers.in_process import gpipe

SMALL = {"layers": 4, "d_model": 256, "ff": 1024, "heads": 8, "seq": 256, "vocab": 1000}
BASE = {"source": "a test", "hardware": "a100-nvlink", "nodes": 1, "model": "transformer", "options": SMALL,
        "tensor_parallel": 2, "pipeline_stages": 2, "replicas": 2, "context_parallel": 1, "virtual_stages": 1,
        "microbatch_size": 2, "global_batch": 16, "checkpoint": "full", "sequence_parallel": True,
        "precision": "bf16", "attention": "flash", "compile": False, "zero": 1, "measured_step_s": 0.01}
LLAMA = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 1000, "seq": 256}
STATED = ("checkpoint", "sequence_parallel", "virtual_stages", "microbatch_size", "zero", "attention", "compile")


def row(run_id: str, **change) -> dict:
    return {"id": run_id, **BASE, **change}


def replayed(tmp_path, runs: list[dict], capsys) -> dict[str, dict]:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    assert main(["replay", str(path), "--json"]) == 0
    return {r["id"]: r for r in json.loads(capsys.readouterr().out)["runs"]}


def nulls(run: dict) -> list[str]:
    """The run's lines about its unsaid fields."""
    return [a for a in run["assumed"] if a.split(" ", 1)[0] in STATED]


def test_every_null_is_searched_within_the_layout_and_named_with_the_value_chosen(tmp_path, capsys):
    runs = replayed(tmp_path, [
        row("stated"),
        row("checkpoint", checkpoint=None),
        row("microbatch", microbatch_size=None),
        row("sequence", sequence_parallel=None),
        row("zero", zero=None),
        row("virtual", virtual_stages=None),
        row("attention", attention=None),
        row("compile", compile=None),
        row("left-out", **{key: None for key in ("attention", "compile", "zero")}),
    ], capsys)
    assert all(r["modelled"] for r in runs.values()), [r["reason"] for r in runs.values()]
    assert nulls(runs["stated"]) == []
    layout = {name: r["layout"] for name, r in runs.items()}
    # the stated layout is kept: T, D, K and C never move
    assert {(l["tensor_parallel"], l["replicas"], l["pipeline_stages"], l["context_parallel"])
            for l in layout.values()} == {(2, 2, 2, 1)}
    checkpoint = layout["checkpoint"]["checkpoint"]
    assert checkpoint in ("never", "selective", "full")
    assert nulls(runs["checkpoint"]) == [f"checkpoint null: {checkpoint}, the fastest of never, selective and "
                                         "full that fits"]
    rows = layout["microbatch"]["microbatch_rows"]
    assert nulls(runs["microbatch"]) == [f"microbatch_size null: {rows}, the fastest of the sizes dividing a "
                                         "replica's batch that fits"]
    sequence = "on" if layout["sequence"]["sequence_parallel"] else "off"
    assert nulls(runs["sequence"]) == [f"sequence_parallel null: {sequence}, the fastest of off and on that fits"]
    assert nulls(runs["zero"]) == [f"zero null: {layout['zero']['zero']}, the fastest of 0 and 1 that fits"]
    virtual = layout["virtual"]
    assert nulls(runs["virtual"]) == [f"virtual_stages null: {virtual['virtual_stages']} ({virtual['schedule']}), "
                                      "the fastest of 1, 2 and 4 that fits"]
    # a null kernel is flash on an A100, as its trainers run it; a null compile is eager's
    assert nulls(runs["attention"]) == ["attention null: flash, as trainers run it on A100-SXM-80GB"]
    assert runs["attention"]["predicted_step_s"] == runs["stated"]["predicted_step_s"]
    assert nulls(runs["compile"]) == ["compile null: not compiled, every elementwise op's memory traffic counted"]
    assert runs["compile"]["predicted_step_s"] == runs["stated"]["predicted_step_s"]
    # a left-out optional key is null
    assert sorted(nulls(runs["left-out"])) == sorted(nulls(runs["attention"]) + nulls(runs["compile"])
                                                     + nulls(runs["zero"]))
    # searching never loses to the stated values it could have chosen
    for name in ("checkpoint", "microbatch", "sequence", "zero", "virtual"):
        assert runs[name]["predicted_step_s"] <= runs["stated"]["predicted_step_s"] * (1 + 1e-12)


def test_nulls_with_nothing_to_choose_say_so(tmp_path, capsys):
    runs = replayed(tmp_path, [row("one", tensor_parallel=1, pipeline_stages=1, replicas=1, sequence_parallel=None,
                                   virtual_stages=None, zero=None)], capsys)
    assert sorted(nulls(runs["one"])) == ["sequence_parallel null: off (no tensor parallelism)",
                                          "virtual_stages null: 1 (one pipeline stage)",
                                          "zero null: 0 (one replica)"]


def test_attention_and_compile_at_the_top_of_a_run(tmp_path, capsys):
    runs = replayed(tmp_path, [
        row("eager", attention="eager"),
        row("fused", attention="fused"),
        row("fused-in-options", attention=None, options={**SMALL, "attention": "fused"}),
        row("eager-compiled", attention="eager", compile=True),
        row("both", attention="flash", options={**SMALL, "attention": "fused"}),
        row("mlp", model="mlp", options={"layers": 4, "width": 64}, tensor_parallel=1, sequence_parallel=False,
            precision="bf16-autocast", attention="fused"),
        row("mlp-compiled", model="mlp", options={"layers": 4, "width": 64}, tensor_parallel=1,
            sequence_parallel=False, precision="bf16-autocast", attention=None, compile=True),
    ], capsys)
    assert runs["fused"]["predicted_step_s"] == runs["fused-in-options"]["predicted_step_s"]
    assert runs["fused"]["predicted_step_s"] != runs["eager"]["predicted_step_s"]
    # compiled, the eager softmax's and the residual stream's elementwise traffic is counted once per region
    assert runs["eager-compiled"]["predicted_step_s"] < runs["eager"]["predicted_step_s"]
    assert nulls(runs["eager-compiled"]) == []
    assert not runs["both"]["modelled"]
    assert runs["both"]["reason"] == "attention is 'flash' at the top of the run but 'fused' in its options; give one"
    assert runs["mlp"]["modelled"]
    assert "attention fused not applied: mlp is priced as its own layers run" in runs["mlp"]["assumed"]
    assert not runs["mlp-compiled"]["modelled"] and "compile is modelled for the built-in transformer" in \
        runs["mlp-compiled"]["reason"]


def test_a_hugging_face_model_takes_the_runs_attention_tensor_parallelism_and_nulls(tmp_path, capsys):
    pytest.importorskip("transformers")
    hf = {"model": "hf:llama", "options": LLAMA}
    shaped = {"layers": 4, "d_model": 256, "ff": 688, "heads": 8, "kv_heads": 2, "vocab": 1000, "seq": 256,
              "activation": "swiglu", "dropout": 0.0, "norm": "rmsnorm", "biases": "none", "positions": "rotary"}
    runs = replayed(tmp_path, [row("hf-fused", **hf, attention="fused", checkpoint=None),
                               row("hf-flash", **hf, checkpoint=None),
                               row("shape-fused", options=shaped, attention="fused", checkpoint=None)], capsys)
    fused, flash = runs["hf-fused"], runs["hf-flash"]
    assert fused["modelled"] and flash["modelled"], (fused["reason"], flash["reason"])
    assert not any("planned by its config's shape" in a for a in fused["assumed"])  # priced by its structure
    assert fused["layout"]["tensor_parallel"] == 2
    assert [a for a in nulls(fused) if a.startswith("attention")] == []
    assert fused["predicted_step_s"] == runs["shape-fused"]["predicted_step_s"]  # the transformer of its shape
    assert fused["predicted_step_s"] > flash["predicted_step_s"]  # materialised scores cost what flash saves
    assert [a.split(",")[0] for a in nulls(fused)] == [f"checkpoint null: {fused['layout']['checkpoint']}"]


def test_bf16_in_a_runs_file_is_the_trainers_mixed_precision(tmp_path, capsys):
    runs = replayed(tmp_path, [row("bf16"), row("bf16-model", precision="bf16-model"),
                               row("autocast", precision="bf16-autocast")], capsys)
    assert runs["bf16"]["predicted_step_s"] == runs["bf16-model"]["predicted_step_s"]
    assert runs["autocast"]["predicted_step_s"] > runs["bf16"]["predicted_step_s"]  # fp32 activations and casts


@pytest.mark.parametrize("change,message", [
    ({"checkpoint": "sometimes"}, "checkpoint 'sometimes'; give one of"),
    ({"zero": 5}, "zero 5; give 0, 1"),
    ({"zero": "3"}, "zero '3'; give 0, 1"),
    ({"zero": 3, "shard_group": 3}, "--shard-group 3 does not divide --replicas 2"),
    ({"zero": 1, "shard_group": 2}, "shard_group 2 with zero 1"),
    ({"zero": 1, "gradient_sync": "step"}, "--gradient-sync step says when sharded gradients"),
    ({"zero": 3, "gradient_sync": "sometimes"}, "--gradient-sync must be step or microbatch"),
    ({"zero": 3, "use_megatron_fsdp": "yes"}, "use_megatron_fsdp 'yes'; give true, false"),
    ({"zero": 3, "use_megatron_fsdp": True, "gradient_sync": "step"}, "gradient_sync step with use_megatron_fsdp"),
    ({"microbatch_size": 0}, "microbatch_size 0; give a positive integer"),
    ({"compile": "yes"}, "compile='yes' for model transformer; use true"),
    ({"tensor_parallel": "two"}, "tensor_parallel 'two'; give a positive integer"),
    ({"global_batch": None}, "global_batch null: the replay needs the batch"),
    ({"tensor_parallel": 2, "replicas": 16}, "need 64 devices"),
])
def test_a_stated_value_the_replay_cannot_take_is_one_line(tmp_path, capsys, change, message):
    run = replayed(tmp_path, [row("bad", **change)], capsys)["bad"]
    assert not run["modelled"] and message in run["reason"] and "\n" not in run["reason"]


def test_a_run_without_a_key_of_the_schema_is_one_line(tmp_path):
    bad = row("no-checkpoint")
    del bad["checkpoint"]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [row("fine"), bad]}))
    proc = gpipe("replay", str(path))
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("gpipe: error: run 'no-checkpoint' of ") and "has no checkpoint;" in proc.stderr


def test_zero_and_shard_group_are_read_and_priced_as_fsdp(tmp_path, capsys):
    runs = replayed(tmp_path, [row("one"), row("fsdp", zero=3), row("grads", zero=2),
                               row("hsdp", replicas=4, nodes=2, zero=3, shard_group=2)], capsys)
    assert all(run["modelled"] for run in runs.values())
    assert [runs[name]["layout"]["zero"] for name in ("one", "fsdp", "grads", "hsdp")] == [1, 3, 2, 3]
    assert runs["hsdp"]["layout"]["shard_group"] == 2 and "shard_group" not in runs["fsdp"]["layout"]
    # gathers and reduce-scatters in place of the all-reduce, the optimizer on the shard: another step
    assert runs["fsdp"]["predicted_step_s"] != runs["one"]["predicted_step_s"]


def test_gradient_sync_is_read_and_null_is_the_trainers_default(tmp_path, capsys):
    one_stage = dict(pipeline_stages=1, zero=3, microbatch_size=1, checkpoint="never")
    runs = replayed(tmp_path, [row("default", **one_stage), row("step", **one_stage, gradient_sync="step"),
                               row("each", **one_stage, gradient_sync="microbatch"),
                               row("piped", zero=3), row("piped-each", zero=3, gradient_sync="microbatch")], capsys)
    assert all(run["modelled"] for run in runs.values())
    assert [runs[n]["layout"]["gradient_sync"] for n in runs] == ["microbatch", "step", "microbatch", "step",
                                                                  "microbatch"]
    assert runs["default"]["predicted_step_s"] == runs["each"]["predicted_step_s"]
    # 8 micro-batches a replica: 7 more reduce-scatters than once a step
    assert runs["each"]["predicted_step_s"] > runs["step"]["predicted_step_s"]
    assert runs["piped-each"]["predicted_step_s"] > runs["piped"]["predicted_step_s"]
    assert "gradient_sync" not in replayed(tmp_path, [row("zero1")], capsys)["zero1"]["layout"]


def test_a_stated_pipeline_split_is_the_partition_and_null_is_balanced_and_said(tmp_path, capsys):
    runs = replayed(tmp_path, [row("balanced"), row("even", pipeline_split="even"),
                               row("listed", pipeline_split=[1, 3]),
                               row("interleaved", virtual_stages=2, microbatch_size=1, pipeline_split="even"),
                               row("one-stage", pipeline_stages=1, replicas=4, nodes=1),
                               row("v-searched", virtual_stages=None, microbatch_size=1, pipeline_split="even")],
                      capsys)
    assert all(run["modelled"] for run in runs.values()), [run["reason"] for run in runs.values()]
    # the embedding with the first chunk, the head with the last, the layers as stated
    assert runs["even"]["layout"]["partition"] == [3, 3]
    assert runs["listed"]["layout"]["partition"] == [2, 4]
    assert runs["interleaved"]["layout"]["partition"] == [2, 1, 1, 2]
    assert runs["listed"]["predicted_step_s"] > runs["even"]["predicted_step_s"]
    # a null V searches the Vs the split allows (1 and 2 of 1, 2 and 4: 4 layers do not split over 8 chunks)
    searched = runs["v-searched"]["layout"]
    assert (searched["virtual_stages"], searched["partition"]) in ((1, [3, 3]), (2, [2, 1, 1, 2]))
    split_lines = {name: [a for a in run["assumed"] if a.startswith("pipeline_split")] for name, run in runs.items()}
    assert split_lines["balanced"] == ["pipeline_split null: the layers balanced by their time (min-max), as gpipe "
                                       "plan splits them"]
    assert split_lines["even"] == split_lines["listed"] == split_lines["one-stage"] == []


@pytest.mark.parametrize("split,message", [
    ("even", "4 transformer layers do not split evenly over K x V = 3 chunks"),
    ([1, 1, 1], "give K x V = 3 counts summing to the model's 4 transformer layers"),
    ("balanced", "pipeline_split 'balanced'; give \"even\""),
])
def test_a_pipeline_split_the_layout_cannot_take_is_one_line(tmp_path, capsys, split, message):
    run = replayed(tmp_path, [row("bad", pipeline_stages=3, replicas=1, pipeline_split=split)], capsys)["bad"]
    assert not run["modelled"] and message in run["reason"] and "\n" not in run["reason"]


QWEN_MOE = {"hidden_size": 256, "num_hidden_layers": 4, "moe_intermediate_size": 128, "num_experts": 16,
            "num_experts_per_tok": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 1000, "seq": 256}


def test_moe_capacity_factor_prices_token_dropping_padded_to_capacity(tmp_path, capsys):
    moe = dict(model="hf:qwen3_moe", options=QWEN_MOE, tensor_parallel=1, pipeline_stages=1, replicas=8, nodes=2,
               expert_parallel=8, expert_tensor_parallel=1, sequence_parallel=False, microbatch_size=1,
               global_batch=16, hardware="h100-nvlink")
    runs = replayed(tmp_path, [row("dropless", **moe), row("padded", **moe, moe_capacity_factor=1.0),
                               row("wider", **moe, moe_capacity_factor=1.5),
                               row("both", **{**moe, "options": {**QWEN_MOE, "capacity_factor": 1.0}},
                                   moe_capacity_factor=1.5),
                               row("dense", moe_capacity_factor=1.0)], capsys)
    # at 1.0 every expert rank computes the mean load: faster than the most loaded rank of a dropless router
    assert runs["padded"]["predicted_step_s"] < runs["dropless"]["predicted_step_s"]
    assert runs["wider"]["predicted_step_s"] > runs["padded"]["predicted_step_s"]  # 1.5x the assignments
    for name, message in (("both", "moe_capacity_factor is 1.5 but the options' capacity_factor 1.0"),
                          ("dense", "moe_capacity_factor 1.0 for transformer, which has no experts")):
        assert not runs[name]["modelled"] and message in runs[name]["reason"] and "\n" not in runs[name]["reason"]


def test_moe_a2a_overlap_hides_the_all_to_alls_behind_another_micro_batchs_compute(tmp_path, capsys):
    moe = dict(model="hf:qwen3_moe", options=QWEN_MOE, tensor_parallel=1, pipeline_stages=1, replicas=8, nodes=2,
               expert_parallel=8, expert_tensor_parallel=1, sequence_parallel=False, microbatch_size=1,
               global_batch=16, hardware="h100-nvlink")
    runs = replayed(tmp_path, [row("exposed", **moe), row("off", **moe, moe_a2a_overlap=False),
                               row("overlapped", **moe, moe_a2a_overlap=True),
                               row("dense", moe_a2a_overlap=True), row("bad", **moe, moe_a2a_overlap="yes")], capsys)
    assert runs["overlapped"]["predicted_step_s"] < runs["off"]["predicted_step_s"] == runs["exposed"]["predicted_step_s"]
    lines = {name: [a for a in run["assumed"] if a.startswith("moe_a2a_overlap")] for name, run in runs.items()}
    assert lines["exposed"] == ["moe_a2a_overlap null: off, every all-to-all exposed (Megatron-Core's default)"]
    assert lines["off"] == lines["overlapped"] == []
    for name, message in (("dense", "moe_a2a_overlap true for a model without experts"),
                          ("bad", "moe_a2a_overlap 'yes'; give true, false")):
        assert not runs[name]["modelled"] and message in runs[name]["reason"] and "\n" not in runs[name]["reason"]


def test_moe_dispatcher_sends_one_copy_per_node_and_cuda_graphs_drop_the_layers_fixed_time(tmp_path, capsys):
    """The flex dispatcher's DeepEP and HybridEP send a token once to each other node its experts are on
    (E = 8 over two nodes of 4 here: fewer bytes over the network than a copy per assignment); a graphed
    run pays no MoE layer's fixed per-pass time; a stated dispatcher or graphs say nothing in assumed."""
    moe = dict(model="hf:qwen3_moe", options=QWEN_MOE, tensor_parallel=1, pipeline_stages=1, replicas=8, nodes=2,
               expert_parallel=8, expert_tensor_parallel=1, sequence_parallel=False, microbatch_size=1,
               global_batch=16, hardware={"base": "h100-nvlink", "gpus_per_node": 4})
    runs = replayed(tmp_path, [row("unstated", **moe), row("alltoall", **moe, moe_dispatcher="alltoall"),
                               row("hybridep", **moe, moe_dispatcher="flex/hybridep"),
                               row("deepep", **moe, moe_dispatcher="deepep"),
                               row("graphed", **moe, moe_dispatcher="alltoall", cuda_graphs=True),
                               row("bad", **moe, moe_dispatcher="nvshmem"),
                               row("dense", moe_dispatcher="alltoall")], capsys)
    step = {name: run["predicted_step_s"] for name, run in runs.items()}
    assert step["unstated"] == step["alltoall"]
    assert step["hybridep"] == step["deepep"] < step["alltoall"]
    assert step["graphed"] < step["alltoall"]
    lines = {name: [a for a in run["assumed"] if a.startswith("moe_dispatcher")] for name, run in runs.items()}
    assert lines["unstated"] == ["moe_dispatcher null: alltoall, one copy of a token per assignment "
                                 "(Megatron-Core's default)"]
    assert lines["alltoall"] == lines["hybridep"] == []
    for name, message in (("bad", "moe_dispatcher 'nvshmem'; use alltoall, flex/deepep or flex/hybridep"),
                          ("dense", "moe_dispatcher 'alltoall' for transformer, which has no experts")):
        assert not runs[name]["modelled"] and message in runs[name]["reason"] and "\n" not in runs[name]["reason"]


def test_a_run_stating_megatron_fsdp_reduces_its_sharded_gradients_after_every_micro_batch(tmp_path, capsys):
    """Megatron-FSDP reduce-scatters sharded gradients after every backward, under a pipeline too
    (sim.evidence.megatron_fsdp): a null gradient_sync takes that, not the pipeline's once a step,
    and says so; stated false or left out, the FSDP2/torch default."""
    runs = replayed(tmp_path, [row("megatron", zero=3, use_megatron_fsdp=True),
                               row("each", zero=3, gradient_sync="microbatch"), row("fsdp2", zero=3),
                               row("not-megatron", zero=3, use_megatron_fsdp=False),
                               row("megatron-zero1", use_megatron_fsdp=True),
                               row("one-stage", zero=2, pipeline_stages=1, use_megatron_fsdp=True)], capsys)
    assert all(run["modelled"] for run in runs.values())
    syncs = {name: run["layout"].get("gradient_sync") for name, run in runs.items()}
    assert syncs == {"megatron": "microbatch", "each": "microbatch", "fsdp2": "step", "not-megatron": "step",
                     "megatron-zero1": None, "one-stage": "microbatch"}
    assert runs["megatron"]["predicted_step_s"] == runs["each"]["predicted_step_s"]
    assert runs["megatron"]["predicted_step_s"] > runs["fsdp2"]["predicted_step_s"]  # 3 more reduce-scatters
    assert runs["fsdp2"]["predicted_step_s"] == runs["not-megatron"]["predicted_step_s"]
    said = {name: [a for a in run["assumed"] if a.startswith("gradient_sync null")] for name, run in runs.items()}
    assert [len(said[name]) for name in runs] == [1, 0, 0, 0, 0, 1]
    assert said["megatron"][0].startswith("gradient_sync null: microbatch, as Megatron-FSDP runs it")
