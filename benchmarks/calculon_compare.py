"""Calculon (Isaev et al., SC'23) on the published GPU runs, beside `gpipe replay`, per source group.

Calculon is not part of the project and is not vendored: install it yourself from a checkout of
https://github.com/calculon-ai/calculon (`.venv/bin/pip install -e CHECKOUT pandas psutil`; its
package imports pandas and psutil without declaring them). Each run of a runs file is translated into
Calculon's three inputs and priced with its own performance model (`Llm.compile` then `Llm.run`,
what `calculon llm APP EXE SYSTEM` does):

- application: hidden, feedforward, seq, heads, head size and blocks from the run's options. A gated
  MLP (Llama's SwiGLU: three h x f matrices) becomes Calculon's two-matrix MLP of width 1.5 f, the
  same matmul FLOPs and weights; grouped-query attention (fewer KV heads than heads) becomes its
  `multiquery` (one K and V head), equal heads `multihead`. Calculon has no embedding, LM head or
  loss, prices attention with its scores materialised (no flash attention) and dropout always.
- execution: T, K, D, micro-batch, V, `checkpoint` full / selective / never as `full` / `attn_only`
  / `none`; sequence parallelism as Calculon's `rs_ag` tensor-parallel communication (else `ar`),
  its all-gather redone in the backward (`seq_par_ag_redo`) as Megatron-LM does unless recompute is
  full; ZeRO-1 or a distributed optimizer as `optimizer_sharding`; bf16 as `float16` (the same
  rate and size), fp8 as `float8` (every tensor one byte: Calculon's only fp8); the activation
  fused with its matmul; the trainer's overlap: tensor-parallel communication overlapped (`ring`)
  where the run's notes name userbuffers / TP comm overlap, the data-parallel reduction overlapped
  for NVIDIA's NeMo / Megatron-Bridge recipes (overlapped grad sync) and not for the Megatron-LM
  papers and BLOOM (the papers say it was not). Parallel groups are placed in Megatron-LM's rank
  order (tensor, data, pipeline): on the NVLink tier while the group product fits a node, on the
  scale-out tier after. A null micro-batch (or ZeRO, checkpoint, sequence parallelism) is searched:
  the fastest that Calculon's memory model accepts; a null interleave is 1.
- system: Calculon's own shipped files, `systems/a100_80g.json` for A100 80GB (the file its own
  end-to-end validation uses) and `systems/h100_80g_nvl8.json` for H100 SXM; a hardware object
  overrides that file's memory size, memory bandwidth, peaks, node size and per-GPU network figures.

Not expressible, and said so per run: B200 and GB200 (Calculon ships no system file for them),
context parallelism, ZeRO-2/3 and FSDP, expert parallelism. A run Calculon's memory model says
cannot fit (its attention keeps the scores a flash kernel never stores) although it ran is still
priced, with the capacity check off, and flagged (`fits_calculon_memory`). Writes
benchmarks/results/calculon_validation.json and prints, per source group, the runs both model and the
median absolute error of each tool over them (gpipe's from its replay results file), then the
overall median with each translation choice changed alone.

    .venv/bin/python benchmarks/calculon_compare.py [--gpipe-results benchmarks/results/replay_validation.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import statistics
import sys

try:
    import calculon
    from calculon.llm import Llm
except ImportError as exc:  # one line, how to get it
    print(f"calculon_compare: Calculon is not installed ({exc}); pip install -e a checkout of "
          "https://github.com/calculon-ai/calculon (plus pandas and psutil)", file=sys.stderr)
    raise SystemExit(2) from None

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {"validation": os.path.join(HERE, "published_runs", "validation.json"),
        "dev": os.path.join(HERE, "published_runs", "dev.json")}
GPIPE_RESULTS = {"validation": os.path.join(HERE, "results", "replay_validation.json"),
                 "dev": os.path.join(HERE, "results", "replay_dev.json")}
OUT = os.path.join(HERE, "results", "calculon_validation.json")
SYSTEM_FILES = {"a100-nvlink": "a100_80g.json", "h100-nvlink": "h100_80g_nvl8.json"}
# id prefix -> source group, as docs/simulator.md's published-runs section names the sources
GROUPS = (("narayanan-", "Narayanan et al. 2021 (Megatron-LM)"),
          ("korth-", "Korthikanti et al. 2022 (Megatron-LM)"),
          ("nemo-gpt3-", "DGX Cloud recipes (NeMo)"), ("nemotron4-", "DGX Cloud recipes (NeMo)"),
          ("dgxc", "DGX Cloud recipes (NeMo)"),
          ("mb", "Megatron-Bridge performance summaries"),
          ("nemo2", "NeMo performance summaries"),
          ("bloom-", "BLOOM (Megatron-DeepSpeed)"),
          ("tt-", "torchtitan"))
NEMO_FAMILY = ("DGX Cloud recipes (NeMo)", "Megatron-Bridge performance summaries", "NeMo performance summaries")
TP_OVERLAP_NAMED = re.compile(r"ub_tp_comm_overlap(?! false)|tp comm overlap|tp communication overlap|userbuffers")
UNBOUNDED_GIB = 80e9  # Calculon's a100_80e.json: its validation's way to switch the capacity check off
RECOMPUTE = {"full": "full", "selective": "attn_only", "never": "none"}


@dataclasses.dataclass(frozen=True)
class Translation:
    """The translation choices; the defaults are the comparison's, the others its sensitivity."""
    gated_width: float = 1.5  # a gated MLP's width as a two-matrix MLP's: 1.5 keeps FLOPs and weights
    gqa_as: str = "multiquery"  # Calculon's attention type for fewer KV heads than heads
    fused_activation: bool = True
    tp_overlap: str = "notes"  # "notes": ring where the run names TP comm overlap; or "none" / "ring" everywhere
    dp_overlap: str = "trainer"  # "trainer": NVIDIA's recipes overlap, the papers not; or "never" / "always"
    fp8_as: str = "float8"


VARIANTS = {"gated MLP at its own width (1.0 f)": Translation(gated_width=1.0),
            "grouped-query attention as multihead": Translation(gqa_as="multihead"),
            "activation not fused": Translation(fused_activation=False),
            "no tensor-parallel overlap": Translation(tp_overlap="none"),
            "no data-parallel overlap": Translation(dp_overlap="never"),
            "data-parallel overlap everywhere": Translation(dp_overlap="always"),
            "fp8 priced as float16": Translation(fp8_as="float16")}


class NotExpressible(Exception):
    """A run Calculon cannot describe; the message says what is missing."""


def group_of(run_id: str) -> str:
    return next((name for prefix, name in GROUPS if run_id.startswith(prefix)), "other")


def notes_text(run: dict) -> str:
    return " ".join([run.get("note", ""), *run.get("notes", [])]).lower()


def application(run: dict, how: Translation) -> tuple[dict, str, list[str]]:
    """Calculon's application JSON, its attention type and what the translation chose."""
    o = run["options"]
    if run["model"] == "transformer":
        hidden, ffn, heads, blocks = o["d_model"], o["ff"], o["heads"], o["layers"]
        kv_heads, gated = o.get("kv_heads") or heads, o.get("activation") == "swiglu"
    elif run["model"] in ("hf:llama", "hf:nemotron", "hf:bloom"):
        hidden, ffn = o["hidden_size"], o["intermediate_size"]
        heads, blocks = o["num_attention_heads"], o["num_hidden_layers"]
        kv_heads = o.get("num_key_value_heads") or heads
        gated = run["model"] == "hf:llama"  # LlamaMLP is gated (SwiGLU); Nemotron's relu2 and BLOOM's GELU are not
    else:
        raise NotExpressible(f"model {run['model']} has no translation")
    choices = []
    if gated:
        width = int(ffn * how.gated_width)
        choices.append(f"gated MLP of width {ffn} as a two-matrix MLP of width {width}")
        ffn = width
    attention = "multihead" if kv_heads == heads else how.gqa_as
    if kv_heads != heads:
        choices.append(f"{kv_heads} KV heads of {heads} as {attention}")
    return ({"hidden": hidden, "feedforward": ffn, "seq_size": o["seq"], "attn_heads": heads,
             "attn_size": hidden // heads, "num_blocks": blocks}, attention, choices)


def system(run: dict, systems_dir: str) -> tuple[dict, str]:
    """Calculon's shipped system file for the run's hardware, a hardware object's figures over it."""
    hardware = run["hardware"]
    base = hardware["base"] if isinstance(hardware, dict) else hardware
    if base not in SYSTEM_FILES:
        raise NotExpressible(f"hardware {base}: Calculon ships no system file for it "
                             f"(it has {', '.join(sorted(SYSTEM_FILES.values()))} and a100_80e.json)")
    name = SYSTEM_FILES[base]
    with open(os.path.join(systems_dir, name)) as f:
        sys_json = json.load(f)
    if isinstance(hardware, dict):
        sys_json = copy.deepcopy(sys_json)
        overrides = {"memory_gib": ("mem1", "GiB", 1), "memory_bandwidth_tb_s": ("mem1", "GBps", 1000)}
        for key, (tier, field, scale) in overrides.items():
            if hardware.get(key) is not None:
                sys_json[tier][field] = hardware[key] * scale
        for key, dtype in (("peak_tflops_bf16", "float16"), ("peak_tflops_fp8", "float8")):
            if hardware.get(key) is not None and dtype in sys_json["matrix"]:
                sys_json["matrix"][dtype]["tflops"] = hardware[key]
        if hardware.get("gpus_per_node") is not None:
            sys_json["networks"][0]["size"] = hardware["gpus_per_node"]
        if hardware.get("nic_gbit_s") is not None:
            sys_json["networks"][1]["bandwidth"] = hardware["nic_gbit_s"] / 8  # GB/s per GPU
        name += " with the run's hardware object over it"
    return sys_json, name


def networks(tp: int, dp: int, pp: int, node_size: int) -> tuple[int, int, int]:
    """Tier of each group in Megatron-LM's rank order: NVLink (0) while the product fits a node."""
    tiers, product, on_node = [], 1, True
    for degree in (tp, dp, pp):
        if degree > 1:
            on_node = on_node and product * degree <= node_size and node_size % (product * degree) == 0
            product *= degree
        tiers.append(0 if on_node else 1)
    return tiers[0], tiers[2], tiers[1]


def executions(run: dict, attention: str, node_size: int, how: Translation) -> tuple[list[dict], list[str]]:
    """Calculon's execution JSONs (several where a null field is searched) and the choices made."""
    for key, what in (("context_parallel", "context parallelism"), ("expert_parallel", "expert parallelism")):
        if (run.get(key) or 1) > 1:
            raise NotExpressible(f"{what} {run[key]}: Calculon has none")
    zero = run.get("zero")
    if zero is not None and zero >= 2:
        raise NotExpressible(f"ZeRO-{zero} / FSDP: Calculon shards only the optimizer state")
    if run.get("data_parallel_reduction") == "distributed_optimizer":
        zero = 1
    tp, pp, dp = run["tensor_parallel"], run["pipeline_stages"], run["replicas"]
    precision = run["precision"]
    if precision not in ("bf16", "fp16", "fp8"):
        raise NotExpressible(f"precision {precision}")
    datatype = how.fp8_as if precision == "fp8" else "float16"
    text, group = notes_text(run), group_of(run["id"])
    named = TP_OVERLAP_NAMED.search(text) is not None
    tp_overlap = "none" if tp == 1 else {"notes": "ring" if named else "none"}.get(how.tp_overlap, how.tp_overlap)
    dp_overlap = dp > 1 and {"trainer": group in NEMO_FAMILY, "never": False, "always": True}[how.dp_overlap]
    tn, pn, dn = networks(tp, dp, pp, node_size)
    choices = [f"{precision} as {datatype}", f"tensor-parallel overlap {tp_overlap}",
               f"data-parallel overlap {'on' if dp_overlap else 'off'}"]
    checkpoints = [run["checkpoint"]] if run["checkpoint"] else list(RECOMPUTE)
    sps = [run["sequence_parallel"]] if run.get("sequence_parallel") is not None else [False, True]
    zeros = [zero] if zero is not None else [0, 1]
    if run["checkpoint"] is None or run.get("sequence_parallel") is None or zero is None:
        choices.append("null checkpoint / sequence parallel / ZeRO searched: the fastest Calculon accepts")
    mbs_list = [run["microbatch_size"]] if run.get("microbatch_size") else None
    if mbs_list is None:
        choices.append("null micro-batch searched: the fastest Calculon accepts")
    out = []
    for checkpoint in checkpoints:
        for sp in sps if tp > 1 else [False]:
            for z in zeros if dp > 1 else [0]:
                for mbs in mbs_list or list(Llm.get_valid_microbatch_sizes(
                        run["options"]["seq"], tp, dp, run["global_batch"], pp)):
                    recompute = RECOMPUTE[checkpoint]
                    out.append({
                        "num_procs": tp * pp * dp, "tensor_par": tp, "pipeline_par": pp, "data_par": dp,
                        "tensor_par_net": tn, "pipeline_par_net": pn, "data_par_net": dn,
                        "batch_size": run["global_batch"], "microbatch_size": mbs, "datatype": datatype,
                        "fused_activation": how.fused_activation, "attention_type": attention,
                        "activation_recompute": recompute,
                        "pipeline_interleaving": run.get("virtual_stages") or 1,
                        "optimizer_sharding": bool(z), "tensor_par_comm_type": "rs_ag" if sp else "ar",
                        "tensor_par_overlap": tp_overlap, "seq_par_ag_redo": sp and recompute != "full",
                        "data_par_overlap": dp_overlap, "weight_offload": False,
                        "activations_offload": False, "optimizer_offload": False, "training": True})
    return out, choices


def price(app: dict, exe: dict, sys_json: dict) -> tuple[float, float]:
    """Calculon's step time and the GiB of device memory it says the execution needs.

    Priced with the memory tier made unbounded, as Calculon's own `a100_80e.json` does for its
    validation, so that a run its memory model says cannot fit (its attention keeps the scores a
    flash kernel never stores) still gets a time; the caller compares the need with the device.
    Raises Llm.Error (or AssertionError) where Calculon refuses the layout itself."""
    unbounded = copy.deepcopy(sys_json)
    unbounded["mem1"]["GiB"] = UNBOUNDED_GIB
    model = Llm(Llm.Application(app), logging.getLogger("calculon"))
    model.compile(calculon.System(unbounded), Llm.Execution.from_json(exe))
    model.run(calculon.System(unbounded))
    return model.get_total_time(), model.get_mem_tier1_cap_req() / 1024**3


def predict(run: dict, systems_dir: str, how: Translation = Translation()) -> dict:
    row = {"id": run["id"], "group": group_of(run["id"]), "measured_step_s": run["measured_step_s"],
           "modelled": False, "predicted_step_s": None, "error": None, "reason": ""}
    try:
        sys_json, system_name = system(run, systems_dir)
        app, attention, app_choices = application(run, how)
        exes, exe_choices = executions(run, attention, sys_json["networks"][0]["size"], how)
    except NotExpressible as why:
        row["reason"] = str(why)
        return row
    priced, refusals = [], []
    for exe in exes:
        try:
            step_s, need_gib = price(app, exe, sys_json)
        except (Llm.Error, AssertionError) as why:
            refusals.append(str(why) or type(why).__name__)
            continue
        priced.append((need_gib > sys_json["mem1"]["GiB"], step_s, need_gib, exe))
    row.update(system=system_name, application=app, choices=app_choices + exe_choices)
    if not priced:
        row["reason"] = f"Calculon refuses the layout: {refusals[0]}"
        return row
    over, step_s, need_gib, exe = min(priced, key=lambda p: (p[0], p[1]))  # the fastest that fits, if any
    row.update(modelled=True, predicted_step_s=step_s, error=step_s / run["measured_step_s"] - 1,
               calculon_memory_gib=need_gib, fits_calculon_memory=not over, execution=exe)
    return row


def median_abs(errors: list[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


def table(rows: list[dict], gpipe: dict[str, dict]) -> list[dict]:
    """Per source group and overall: runs, how many each models, both tools' medians on the runs both model."""
    names = [name for _, name in GROUPS]
    groups = sorted({r["group"] for r in rows}, key=names.index) + ["overall"]
    out = []
    for group in groups:
        members = [r for r in rows if group in ("overall", r["group"])]
        both = [r for r in members if r["modelled"] and gpipe.get(r["id"], {}).get("modelled")]
        out.append({"group": group, "runs": len(members),
                    "gpipe_modelled": sum(bool(gpipe.get(r["id"], {}).get("modelled")) for r in members),
                    "calculon_modelled": sum(r["modelled"] for r in members), "both": len(both),
                    "both_over_calculon_memory": sum(not r["fits_calculon_memory"] for r in both),
                    "gpipe_median_abs_error": median_abs([gpipe[r["id"]]["error"] for r in both]),
                    "calculon_median_abs_error": median_abs([r["error"] for r in both]),
                    "calculon_worst_abs_error": max((abs(r["error"]) for r in both), default=None),
                    "gpipe_median_abs_error_within_calculon_memory": median_abs(
                        [gpipe[r["id"]]["error"] for r in both if r["fits_calculon_memory"]]),
                    "calculon_median_abs_error_within_calculon_memory": median_abs(
                        [r["error"] for r in both if r["fits_calculon_memory"]])})
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(name: str, lines: list[dict]) -> None:
    print(f"\n{name}")
    print("| source group | runs | Calculon models (over its memory) | both | gpipe median | Calculon median |")
    print("|---|---|---|---|---|---|")
    for t in lines:
        print(f"| {t['group']} | {t['runs']} | {t['calculon_modelled']} ({t['both_over_calculon_memory']}) | "
              f"{t['both']} | {pct(t['gpipe_median_abs_error'])} | {pct(t['calculon_median_abs_error'])} |")


def sensitivity(runs: list[dict], systems_dir: str, gpipe: dict[str, dict]) -> dict[str, dict]:
    """Each translation choice changed alone: Calculon's runs and median over the runs both model."""
    out = {}
    for name, how in {"as compared": Translation(), **VARIANTS}.items():
        overall = table([predict(run, systems_dir, how) for run in runs], gpipe)[-1]
        out[name] = {"both": overall["both"], "calculon_median_abs_error": overall["calculon_median_abs_error"]}
        print(f"  {name}: {overall['both']} runs, Calculon median {pct(overall['calculon_median_abs_error'])}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_systems = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(calculon.__file__))), "systems")
    parser.add_argument("--systems", default=default_systems, help="Calculon's systems/ folder (its checkout's)")
    parser.add_argument("--gpipe-results", default=GPIPE_RESULTS["validation"])
    parser.add_argument("--gpipe-dev-results", default=GPIPE_RESULTS["dev"])
    args = parser.parse_args()
    if not os.path.isdir(args.systems):
        sys.exit(f"calculon_compare: no Calculon systems folder at {args.systems}; pass --systems CHECKOUT/systems")
    result = {"calculon": {"package_version": importlib.metadata.version("calculon"),
                           "system_files": sorted(SYSTEM_FILES.values())}}
    for name, gpipe_file in (("validation", args.gpipe_results), ("dev", args.gpipe_dev_results)):
        with open(RUNS[name]) as f:
            runs = json.load(f)["runs"]
        with open(gpipe_file) as f:
            gpipe = {r["id"]: r for r in json.load(f)["runs"]}
        rows = [predict(run, args.systems) for run in runs]
        result[name] = {"runs": rows, "table": table(rows, gpipe)}
        print_table(f"{name} ({os.path.relpath(RUNS[name])}; gpipe from {os.path.relpath(gpipe_file)})",
                    result[name]["table"])
        if name == "validation":
            print("\nEach translation choice changed alone (validation, overall):")
            result[name]["sensitivity"] = sensitivity(runs, args.systems, gpipe)
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {os.path.relpath(OUT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
