"""``gpipe plan``: search for the fastest plan that fits, print a ranked table, write the plan file."""

from __future__ import annotations

import argparse
import json
import sys
import time

from sim.cli_options import (add_hardware_arguments, add_model_arguments, add_optimizer_argument,
                             add_precision_argument, check_output_path, parse_int_list, simulation_options)
from sim.errors import GpipeInputError, require_positive
from sim.hardware import get_system
from sim.plan import ModelRef, Plan, save_plan
from sim.planner import PlanOption, SearchResult, default_stage_options, search
from sim.microbatch import split_rows
from sim.precision import check_precision
from sim.report import describe_precision, gib
from sim.schedule import CHECKPOINT_POLICIES, SCHEDULES, check_checkpoint_policy, check_schedule_name
from sim.workload_cli import chosen_precision, workload_and_batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_optimizer_argument(parser)
    add_hardware_arguments(parser, default="cpu")
    add_precision_argument(parser, "the costs file's; else the device's: bf16 on A100, H100, H200 and "
                                   "TPUs, fp32 elsewhere")
    parser.add_argument("--batch", type=int, default=None, help="rows per mini-batch (default per model)")
    parser.add_argument("--stages-options", default=None, metavar="LIST",
                        help="K values to try, e.g. 1,2,4,8 (default: powers of two up to devices and layers)")
    parser.add_argument("--microbatch-options", default="1-64", metavar="LIST",
                        help="M values to try, e.g. 1-64 or 1,4,32 (default 1-64)")
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINT_POLICIES), help="policies to try")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="schedules to try")
    parser.add_argument("--partitioner", default="min_max", choices=("min_max", "variance"))
    parser.add_argument("--top", type=int, default=10, help="rows in the ranked table (default 10)")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the best plan to this file")
    parser.add_argument("--json", action="store_true", help="print the ranked plans as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    whatif = parser.add_argument_group("what-if and limits")
    whatif.add_argument("--max-layers", action="store_true",
                        help="instead of planning: the most layers that fit per K, with and without "
                             "re-materialization, and each stage's memory breakdown")
    whatif.add_argument("--efficiency", type=float, default=None,
                        help="achieved fraction of the device's peak FLOP/s (default: the catalog's)")
    whatif.add_argument("--efficiency-from", default=None, metavar="COSTS",
                        help="take the efficiency fitted by gpipe calibrate from this costs file")
    whatif.add_argument("--input-shape", default=None, metavar="SHAPE",
                        help="one sample's shape for a package.module:factory model, e.g. 3,224,224 "
                             "or 1024:int64 (default: its example_batch)")
    whatif.add_argument("--html", default=None, metavar="FILE",
                        help="write step time, bubble and memory against K and M, and the best "
                             "plan's timeline, as HTML")


def planning_inputs(args: argparse.Namespace):
    """The system (with any efficiency override), the model options and the precision, shared by
    both modes."""
    from sim.whatif import efficiency_from_costs, with_efficiency

    efficiency, bandwidth = args.efficiency, None
    if args.efficiency_from:
        fitted, bandwidth = efficiency_from_costs(args.efficiency_from)
        efficiency = fitted if efficiency is None else efficiency
    system = with_efficiency(get_system(args.hardware, args.nodes), efficiency, bandwidth)
    options = simulation_options(args)
    if args.input_shape:
        options["input_shape"] = args.input_shape
    return system, options, chosen_precision(args, system.device)


def run(args: argparse.Namespace) -> int:
    if args.precision is not None:
        check_precision(args.precision)
    check_output_path(args.out, "--out")
    check_output_path(args.html, "--html")
    if args.max_layers:
        from sim.max_layers_cli import run as run_max_layers

        return run_max_layers(args, *planning_inputs(args))
    require_positive("--top", args.top)
    checkpoints = [check_checkpoint_policy(c) for c in args.checkpoints.split(",")]
    schedules = [check_schedule_name(s) for s in args.schedules.split(",")]
    system, options, precision = planning_inputs(args)
    workload, batch = workload_and_batch(args, options, precision)
    if args.stages_options:
        stage_options = parse_int_list(args.stages_options, "--stages-options")
        too_many = [k for k in stage_options if k > workload.num_layers]
        if too_many:
            raise GpipeInputError(f"--stages-options {too_many[0]} exceeds the model's {workload.num_layers} "
                                  f"layers; use values up to {workload.num_layers}")
        for k in stage_options:
            system.check_fits(k)
    else:
        stage_options = default_stage_options(system, workload.num_layers)
    microbatch_options = parse_int_list(args.microbatch_options, "--microbatch-options")
    progress = None if args.quiet else _Progress()
    if hasattr(workload, "bind"):  # measured costs hold one fit per stage count (sim.costs)
        result = _search_each_stage_count(workload, system, batch, stage_options, microbatch_options,
                                          checkpoints, schedules, args.partitioner, args.top, progress)
    else:
        result = search(workload, system, batch, stage_options, microbatch_options, checkpoints, schedules,
                        args.partitioner, args.top, progress)
    if progress:
        progress.finish()
    if result.best is None:
        raise GpipeInputError(_nothing_fits(result, workload, system, batch, stage_options, microbatch_options,
                                            checkpoints, schedules))
    description = workload.describe()
    if args.out:
        save_plan(to_plan(result.best, description, batch, system.name, system.nodes,
                          planned_optimizer(args, workload), precision), args.out)
    if args.json:
        json.dump({"model": {k: description[k] for k in ("name", "options", "num_layers", "parameter_count")},
                   "parameter_count": description["parameter_count"], "precision": precision,
                   "candidates": result.candidates, "simulated": result.simulated,
                   "elapsed_s": result.elapsed_s,
                   "ranked": [_option_dict(o) for o in result.ranked]}, sys.stdout)
        print()
    else:
        print(format_table(result, description, system.name, batch, precision))
        if args.out:
            print(f"plan written to {args.out}")
    if args.html:
        from sim.whatif import write_whatif_html

        write_whatif_html(workload, system, batch, stage_options, microbatch_options, result.best, args.html)
        if not args.json:
            print(f"what-if curves written to {args.html}")
    return 0


def _search_each_stage_count(workload, system, batch: int, stage_options: list[int], microbatch_options: list[int],
                             checkpoints: list[str], schedules: list[str], partitioner: str, top: int,
                             progress) -> SearchResult:
    """Search K by K with the measured workload bound to each K, then merge the rankings."""
    parts = []
    for k in stage_options:
        bound, bound_system = workload.bind(system, k)
        parts.append(search(bound, bound_system, batch, [k], microbatch_options, checkpoints, schedules,
                            partitioner, top, progress))
    ranked = sorted((o for part in parts for o in part.ranked),
                    key=lambda o: (o.step_time_s, o.max_peak_memory_bytes, o.candidate.stages))[:top]
    return SearchResult(ranked=ranked, candidates=sum(p.candidates for p in parts),
                        simulated=sum(p.simulated for p in parts), not_fitting=sum(p.not_fitting for p in parts),
                        elapsed_s=sum(p.elapsed_s for p in parts),
                        unfit_examples=[o for p in parts for o in p.unfit_examples][:5])


def planned_optimizer(args: argparse.Namespace, workload) -> str:
    """``--optimizer``, else the one a costs file measured with, else the default."""
    from sim.optimizers import DEFAULT_OPTIMIZER

    return args.optimizer or getattr(workload, "optimizer", None) or DEFAULT_OPTIMIZER


def to_plan(option: PlanOption, description: dict, batch: int, system: str, nodes: int, optimizer: str,
            precision: str) -> Plan:
    """The plan file of ``option``; the precision is the plan's own field, not a model option."""
    c = option.candidate
    assert option.result is not None and option.partition is not None
    options = {k: v for k, v in description["options"].items() if k != "precision"}
    return Plan(
        model=ModelRef(name=description["name"], options=options,
                       num_layers=description["num_layers"],
                       parameter_count=description["parameter_count"]),
        partition=tuple(option.partition), batch_size=batch, microbatches=c.microbatches,
        checkpoint=c.checkpoint, schedule=c.schedule, hardware={"system": system, "nodes": nodes},
        predicted=option.result.to_dict(), optimizer=optimizer, precision=precision,
    )


def _option_dict(option: PlanOption) -> dict:
    c = option.candidate
    assert option.result is not None
    return {"stages": c.stages, "microbatches": c.microbatches, "checkpoint": c.checkpoint,
            "schedule": c.schedule, "partition": option.partition, **{
                k: v for k, v in option.result.to_dict().items() if k not in ("partition", "schedule", "checkpoint")}}


def format_table(result: SearchResult, description: dict, system: str, batch: int, precision: str) -> str:
    head = (f"model {description['name']} ({description['num_layers']} layers, "
            f"{description['parameter_count'] / 1e6:.1f}M parameters), batch {batch}, on {system}, "
            f"precision {describe_precision(precision)}: "
            f"{result.candidates} candidates, {result.simulated} simulated, {result.not_fitting} do not fit, "
            f"{result.elapsed_s:.2f} s")
    rows = [head, f"{'rank':>4} {'K':>3} {'M':>3} {'checkpoint':<11} {'schedule':<8} {'step ms':>10} "
                  f"{'bubble':>7} {'samples/s':>10} {'peak mem':>10}  partition"]
    for rank, option in enumerate(result.ranked, 1):
        c = option.candidate
        r = option.result
        assert r is not None
        rows.append(f"{rank:>4} {c.stages:>3} {c.microbatches:>3} {c.checkpoint:<11} {c.schedule:<8} "
                    f"{r.step_time_s * 1e3:>10.3f} {r.bubble_fraction:>7.1%} "
                    f"{r.throughput_samples_per_s:>10.1f} {gib(option.max_peak_memory_bytes):>10}  "
                    f"{','.join(map(str, option.partition or []))}")
    return "\n".join(rows)


def _nothing_fits(result: SearchResult, workload, system, batch: int, stage_options: list[int],
                  microbatch_options: list[int], checkpoints: list[str], schedules: list[str]) -> str:
    """Why nothing fits, told on the candidate that needs the least memory: most stages, most
    micro-batches, the most re-materialization searched."""
    from sim.engine import simulate
    from sim.planner import Candidate, default_partition
    from sim.report import fit_advice

    order = ["always", "except_last", "never"]
    policy = min(checkpoints, key=order.index)
    stages = max(stage_options)
    microbatches = len(split_rows(batch, max(microbatch_options)))
    candidate = Candidate(stages, microbatches, policy, schedules[0])
    partition = default_partition(workload, system, batch, candidate)
    leanest = simulate(workload, system, partition, batch, microbatches, policy, schedules[0], record=False)
    return (f"no plan among {result.candidates} candidates fits; even K={stages} M={microbatches} {policy}: "
            + fit_advice(leanest, system))


class _Progress:
    """Progress on stderr for searches that take more than a moment."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int, best: PlanOption | None) -> None:
        now = time.perf_counter()
        if now - self.started < 1.0 or now - self.last < 0.5:
            return
        self.last, self.shown = now, True
        best_text = f", best {best.step_time_s * 1e3:.3f} ms" if best else ""
        print(f"\rsimulating candidates in order of promise: {done}/{total}{best_text}",
              end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.shown:
            print(file=sys.stderr)
