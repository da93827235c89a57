"""Expert parallelism (``gpipe train --expert-parallel E``, gloo, torchrun) against one process.

One process accumulates over the micro-batches the replicas train (:mod:`tests.helpers.moe_parity`):
each replica's ``torch.chunk`` share of the batch split into M. Losses, the routers' auxiliary losses
and gradient norms rtol 1e-5 (bf16: 1e-3), every parameter from the checkpoint as
:func:`tests.helpers.parity.assert_adam_close` holds them, at atol 1e-4 (an expert's gradient adds
its replicas' rows in another order; T = 2 splits each expert as the tensor-parallel tests do) and bf16
at 2e-3, as tests/executor/test_moe_parallel.py holds experts under T and D (E = 1 there). Three
launches share the matrix: K in {1, 2}, T in {1, 2}, top-1 and top-2, shared experts on and off,
AdamW with clipping, fp32 and bf16, D = E and D = 2E (experts summed over their own replicas) on an
uneven batch. The first is traced (dispatch and combine spans), counts each rank's bytes, and its
checkpoint resumes without expert parallelism; the second resumes a checkpoint saved without it under
it: both continue one process's run (two launches each: marked slow; the other two run in the quick suite).
Two more launches (slow) train under the split backward, zb-h1 and dualpipev, traced; one more (slow)
at D = E = 4 on two tokens a replica, where some rank's experts receive no row, and one (slow) where
experts no row reached are skipped under ZeRO-1 with E = 2 (more ZeRO-1 in
tests/executor/test_expert_parallel_zero1.py).
"""

import shutil

import pytest

from executor.config import RunConfig
from tests.helpers.expert_runs import assert_bytes_as_simulated, assert_trains_as_one_process, reference, train
from tests.helpers.in_process import option_flags, train_refusal
from tests.helpers.moe_parity import MOE

def expert_share_bytes(model, first, end, experts):
    """Parameter bytes (fp32) one rank holds of layers first..end-1: its routed experts' divided by E."""
    return sum(p.numel() * 4 // (experts if ".experts." in name else 1) for name, p in model.named_parameters()
               if first <= int(name.split(".")[0]) < end)


@pytest.mark.slow
def test_two_stages_of_experts_sharded_over_two_replicas_train_as_one_process_and_resume_without(tmp_path):
    """K = 2, D = E = 2, top-2 with a shared expert, SwiGLU, fp32: traced; saved after two steps, resumed
    at E = 1 for the third; each rank's bytes hold n/E experts."""
    options = {**MOE, "top_k": 2, "shared_experts": 1, "activation": "swiglu"}
    common = ["--stages", "2", "--partition", "2,2", "--replicas", "2", "--batch", "8", "--microbatches", "2"]
    report, root = train(tmp_path, "ep", options, *common, "--expert-parallel", "2", "--steps", "2",
                         "--save-every", "2", "--trace", str(tmp_path / "trace.json"))
    assert_trains_as_one_process(report, root, 2, reference(options, 8, 2, 2, 2), 2)
    # dispatch and combine: spans of their own inside the forward, recompute or backward that issued them
    records = report["timeline"]["records"]
    exchanges = [r for r in records if r["kind"] in ("dispatch_ep", "combine_ep")]
    assert {r["kind"] for r in exchanges} == {"dispatch_ep", "combine_ep"}
    for r in exchanges:
        assert any(c["kind"] in ("F", "R", "B") and c.get("replica", 0) == r.get("replica", 0)
                   and c["stage"] == r["stage"] and c["microbatch"] == r["microbatch"]
                   and c["start_s"] <= r["start_s"] <= r["end_s"] <= c["end_s"] for c in records), r
    # every rank: its stage's non-expert parameters whole and half of its routed experts, a gradient each,
    # AdamW's two moments per parameter (the scalar step counters left out, as ZeRO-2/3's are counted)
    model = reference(options, 8, 2, 2, 0)[3]
    bounds = {0: (0, 2), 1: (2, 4)}
    for entry in report["ranks"]:
        nbytes = expert_share_bytes(model, *bounds[entry["stage"]], 2)
        assert entry["parameter_bytes"] == entry["gradient_bytes"] == nbytes, entry
        assert entry["optimizer_state_bytes"] == 2 * nbytes, entry
    shutil.copytree(root, tmp_path / "resumed")
    resumed, _ = train(tmp_path, "resumed", options, *common, "--steps", "3", "--resume", "--save-every", "3")
    assert_trains_as_one_process(resumed, tmp_path / "resumed", 2, reference(options, 8, 2, 2, 3), 3)


@pytest.mark.slow
def test_experts_split_by_tensor_parallelism_resume_from_one_rank_each_into_two_and_train_as_one_process(tmp_path):
    """K = 1, T = 2 (each expert split as the dense MLP is), D = 2, top-1 without shared experts, GELU,
    1F1B: two steps at E = 1 saved, the third at E = 2 from that checkpoint (each rank takes its experts
    from the whole stage). (In bf16, T = 2 alone already routes a token of this model otherwise than one
    process at step 0: the row-parallel partial sums round in bf16; so bf16 is held at T = 1 below.)"""
    options = {**MOE, "top_k": 1, "shared_experts": 0, "activation": "gelu"}
    common = ["--stages", "1", "--replicas", "2", "--tensor-parallel", "2", "--batch", "8", "--microbatches", "2",
              "--schedule", "1f1b"]
    report, root = train(tmp_path, "ep", options, *common, "--steps", "2", "--save-every", "2")
    assert report["losses"] == pytest.approx(reference(options, 8, 2, 2, 2)[0], rel=1e-5)
    resumed, _ = train(tmp_path, "ep", options, *common, "--expert-parallel", "2", "--steps", "3", "--resume",
                       "--save-every", "3")
    assert_trains_as_one_process(resumed, root, 1, reference(options, 8, 2, 2, 3), 3)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,layers,partition,microbatches,checkpoint", [
    ("zb-h1", 2, "2,2", 2, "except_last"),
    ("dualpipev", 4, "2,1,1,2", 4, "never"),  # an MoE block on every chunk; device 0 holds the first and the last
])
def test_experts_sharded_over_two_replicas_train_as_one_process_under_the_split_backward(tmp_path, schedule, layers,
                                                                                          partition, microbatches,
                                                                                          checkpoint):
    """K = 2, D = E = 2, top-2 with a shared expert, fp32, traced. The reverse all-to-alls run in I, on
    the input-gradient path (on the first stage, whose inputs need no gradient, in W, the whole
    backward there); W reaches only weights; dualpipev runs full backwards (B) too."""
    options = {**MOE, "layers": layers, "top_k": 2, "shared_experts": 1}
    report, root = train(tmp_path, "ep", options, "--stages", "2", "--partition", partition, "--schedule", schedule,
                         "--virtual-stages", str(len(partition.split(",")) // 2), "--replicas", "2",
                         "--expert-parallel", "2", "--batch", "8", "--microbatches", str(microbatches),
                         "--checkpoint", checkpoint, "--steps", "2", "--save-every", "2",
                         "--trace", str(tmp_path / "trace.json"))
    chunks = len(partition.split(","))
    assert_trains_as_one_process(report, root, chunks, reference(options, 8, 2, microbatches, 2), 2)
    # each all-to-all a span inside the one action that issued it (the chunk's own, under dualpipev)
    records = report["timeline"]["records"]
    issued_by = {}  # (issuing action's kind, virtual stage) -> the all-to-alls' kinds
    for r in (r for r in records if r["kind"] in ("dispatch_ep", "combine_ep")):
        spans = [c for c in records if c["kind"] in ("F", "R", "B", "I", "W") and c.get("replica", 0) == r.get("replica", 0)
                 and (c["stage"], c.get("virtual_stage")) == (r["stage"], r.get("virtual_stage"))
                 and c["microbatch"] == r["microbatch"] and c["start_s"] <= r["start_s"] <= r["end_s"] <= c["end_s"]]
        assert len(spans) == 1, r
        stage = spans[0]["stage"] if spans[0].get("virtual_stage") is None else spans[0]["virtual_stage"]
        issued_by.setdefault((spans[0]["kind"], stage), set()).add(r["kind"])
    both = {"dispatch_ep", "combine_ep"}
    assert all(kinds == both for kinds in issued_by.values()), issued_by
    # the backward's in I past the first stage, in W on the first only (there W is the whole backward)
    assert {stage for kind, stage in issued_by if kind == "W"} == {0}, issued_by
    assert {stage for kind, stage in issued_by if kind == "I"} == set(range(1, chunks)), issued_by
    assert {stage for kind, stage in issued_by if kind == "F"} == set(range(chunks)), issued_by


def test_experts_summed_over_their_own_replicas_train_as_one_process_on_an_uneven_batch(tmp_path):
    """K = 1, D = 4, E = 2: each expert on two replicas, its gradient summed over them; a batch of 11 rows
    (3, 3, 3, 2 per replica, each in two micro-batches), top-2 with a shared expert. The simulator's
    per-rank parameter, gradient and optimizer-state bytes of the same layout equal the executor's."""
    options = {**MOE, "top_k": 2, "shared_experts": 1, "activation": "swiglu"}  # gated: as the simulator prices experts
    report, root = train(tmp_path, "ep", options, "--stages", "1", "--replicas", "4", "--expert-parallel", "2",
                         "--batch", "11", "--microbatches", "2", "--schedule", "1f1b", "--steps", "3",
                         "--save-every", "3")
    assert_trains_as_one_process(report, root, 1, reference(options, 11, 4, 2, 3), 3)
    # the simulator's per-rank bytes of the same run (its routed experts split by E) equal the executor's count
    assert len(report["ranks"]) == 4
    assert_bytes_as_simulated(report, options, ["--stages", "1", "--replicas", "4", "--nodes", "2", "--expert-parallel",
                                                "2", "--batch", "11", "--microbatches", "2", "--schedule", "1f1b"],
                              ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"))


def test_experts_sharded_over_two_replicas_train_as_one_process_in_bf16(tmp_path):
    """K = 1, D = E = 2, top-1 with a shared expert, bf16 (autocast). (AdamW in bf16 on micro-batches of
    one row, as the uneven batch above has, leaves one process's parameters by more than 2e-3 at E = 1
    already: each micro-batch's weight gradient is rounded to bf16.)"""
    options = {**MOE, "top_k": 1, "shared_experts": 1}
    report, root = train(tmp_path, "ep", options, "--stages", "1", "--replicas", "2", "--expert-parallel", "2",
                         "--batch", "8", "--microbatches", "2", "--precision", "bf16", "--steps", "3",
                         "--save-every", "3")
    assert_trains_as_one_process(report, root, 1, reference(options, 8, 2, 2, 3, "bf16"), 3, "bf16")


@pytest.mark.parametrize("flags", [["--replicas", "4"], ["--replicas", "4", "--expert-parallel", "2"],
                                   ["--replicas", "2", "--zero", "3", "--microbatches", "2"],
                                   pytest.param(["--replicas", "4", "--expert-parallel", "2", "--zero", "1"],
                                                marks=pytest.mark.slow)],
                         ids=["replicas", "expert-parallel", "zero-3", "expert-parallel-zero-1"])
def test_experts_no_row_reached_are_skipped_as_one_process_skips_them(tmp_path, flags):
    """16 experts, top-1, micro-batches of one row (8 tokens): some expert is reached on one replica only
    (the others add a zero gradient) and some on none (no gradient anywhere: AdamW skips it, its moments
    and step count untouched, as one process's does): with whole replicas, with expert parallelism
    (D = 4: E = 2 sums each expert over its own two replicas), with ZeRO-3 (FSDP2 reduce-scatters
    the same gradients on every rank, per micro-batch) and with ZeRO-1 under E = 2 (the experts'
    optimizer state sharded over their two replicas, which skip the same experts)."""
    options = {**MOE, "experts": 16, "top_k": 1, "shared_experts": 0}
    replicas = int(flags[1])
    microbatches = 2 if "--microbatches" in flags else 1
    argv = flags if "--microbatches" in flags else [*flags, "--microbatches", "1"]
    report, root = train(tmp_path, "sparse", options, "--stages", "1", *argv, "--batch", "4", "--steps", "3",
                         "--save-every", "3")
    absent: set[str] = set()
    expected = reference(options, 4, replicas, microbatches, 3, absent=absent)
    assert_trains_as_one_process(report, root, 1, expected, 3)
    assert any(".experts." in name for name in absent)  # the case this test is for did occur


@pytest.mark.slow
def test_a_rank_whose_experts_no_row_reached_still_runs_its_groups_reverse_all_to_alls(tmp_path):
    """D = E = 4, 16 experts, top-1, two tokens a replica: in some step no token of the group reaches
    any of one rank's four experts of a block. That rank receives no rows, and its backward still runs
    the group's two reverse all-to-alls (sending the gradients of its tokens' outputs to the ranks that
    computed them, and taking its tokens' hidden states' gradients back), as every rank of the group
    does: training equals one process."""
    options = {**MOE, "experts": 16, "top_k": 1, "shared_experts": 0, "seq": 2}
    report, root = train(tmp_path, "idle", options, "--stages", "1", "--replicas", "4", "--expert-parallel", "4",
                         "--batch", "4", "--microbatches", "1", "--steps", "3", "--save-every", "3")
    absent_by_step: list[set[str]] = []
    assert_trains_as_one_process(report, root, 1, reference(options, 4, 4, 1, 3, absent_by_step=absent_by_step), 3)
    idle = [(step, block, rank) for step, absent in enumerate(absent_by_step) for block in (1, 2) for rank in range(4)
            if all(f"{block}.mlp.experts.{e}.0.weight" in absent for e in range(4 * rank, 4 * rank + 4))]
    assert idle  # the case this test is for did occur


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "4", "--expert-tensor-parallel", "2"], "differs from --tensor-parallel 1"),
    (["--replicas", "3", "--batch", "6"], "does not divide T x C x D = 1 x 1 x 3"),
    (["--replicas", "3", "--expert-parallel", "3", "--batch", "6"], "does not divide experts=4"),
    (["--model", "mlp"], "has none that gpipe train shards"),
    (["--option", "top_k=5"], "top_k=5 is above experts=4"),
    (["--replicas", "4", "--zero", "3", "--shard-group", "2"], "HSDP of the routed experts over their expert-data-parallel group"),
    (["--replicas", "4", "--batch", "7", "--microbatches", "2"], "not the same number"),
    (["--expert-parallel", "0"], "must be a positive integer, got 0"),
])
def test_what_expert_parallelism_cannot_run_is_one_line_before_any_worker(capsys, flags, message):
    options = [] if "mlp" in flags else option_flags({**MOE, "layers": 2})
    argv = ["--model", "transformer", *options, "--stages", "1", "--replicas", "2", "--expert-parallel", "2",
            "--batch", "8", "--steps", "1"]
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv and flag != "--option":
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert message in train_refusal(capsys, *argv)


def test_zero1_with_expert_parallelism_passes_the_checks_before_any_worker():
    """ZeRO-1 with E > 1 is no longer refused: the experts' optimizer state is sharded over their own
    replicas (tests/executor/test_expert_parallel_zero1.py trains it)."""
    config = RunConfig.of(model="transformer", options={**MOE, "layers": 2}, partition=(4,), batch_size=8,
                          microbatches=2, replicas=4, expert_parallel=2, zero=1)
    config.validate()


@pytest.mark.parametrize("family,argv,message", [
    ("llama", [], "has none that gpipe train shards"),  # a Hugging Face model without experts
    ("mixtral", ["--zero", "2"], "on a Hugging Face mixture of experts is not supported"),
    ("mixtral", ["--zero", "1"], "with --zero 1 on a Hugging Face mixture of experts is not supported"),
    ("qwen3_moe", ["--replicas", "3", "--expert-parallel", "3", "--batch", "6"], "does not divide experts=4"),
])
def test_expert_parallelism_a_hugging_face_model_cannot_run_is_one_line(capsys, family, argv, message):
    from tests.helpers.moe_parity import HF_MOE_CONFIGS as CONFIGS

    options = {**(CONFIGS.get(family) or {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
                                          "max_position_embeddings": 64}), "seq": 8}
    base = {"--replicas": "2", "--expert-parallel": "2", "--batch": "8"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    err = train_refusal(capsys, "--model", f"hf:{family}", *option_flags(options), "--stages", "1", "--steps", "1",
                        *[x for pair in base.items() for x in pair])
    assert message in err
