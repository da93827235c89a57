"""``gpipe plan``: search for the fastest plan that fits, print a ranked table, write the plan file."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from typing import Any

from gpipe.options import (add_hardware_arguments, add_model_arguments, add_optimizer_argument,
                           add_context_parallel_arguments, add_compile_argument, add_precision_argument,
                           add_sequence_parallel_argument, check_output_path, parse_int_list, simulation_options)
from gpipe.plan_notes import dollars, layout_text, note_lines
from gpipe.plan_rows import PlanRow, best_rows, fold_placements
from gpipe.plan_table import format_table
from sim.catalog.efficiency_note import ASSUMED_EFFICIENCY_RANGE, efficiency_kind, efficiency_text
from sim.catalog.user_systems import resolve_system, system_record
from sim.engine.placement import PLACEMENTS, check_placement
from sim.errors import GpipeInputError, require_positive
from sim.formats.plan import ModelRef, Plan, save_plan
from sim.planner.efficiency_range import RangeEnds
from sim.planner.search import PlanOption, SearchResult, default_replica_options, default_stage_options, search
from sim.schedules.microbatch import split_rows
from sim.views.progress import bars_shown, phase
from sim.workloads.precision import check_precision
from sim.schedules.schedule import (CHECKPOINT_POLICIES, MULTI_CHUNK_SCHEDULES, PLANNED_SCHEDULES, SCHEDULES,
                                    V_SHAPED_SCHEDULES, check_checkpoint_policy, check_schedule_name)
from sim.planner.training_cost import SECONDS_PER_DAY, format_token_count
from sim.workloads.tensor_parallel import (check_context_parallel, check_tensor_parallel, default_sequence_parallel,
                                           with_tensor_parallel)
from sim.workloads.workload import check_checkpoint_for
from gpipe.workload_flags import (calibrated_allreduce, chosen_precision, compiled_note, model_name, planned_from_note,
                                  with_attention_default, workload_and_batch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_optimizer_argument(parser)
    add_hardware_arguments(parser, default="cpu")
    parser.set_defaults(nodes=None)  # one, or as many as --max-devices needs (nodes_for)
    add_precision_argument(parser, "the costs file's; else the device's: bf16 on A100, H100, H200 and "
                                   "TPUs, fp32 elsewhere")
    add_compile_argument(parser)
    parser.add_argument("--batch", type=int, default=None, help="rows per mini-batch (default per model)")
    parser.add_argument("--stages-options", default=None, metavar="LIST",
                        help="K values to try, e.g. 1,2,4,8 (default: powers of two up to devices and layers)")
    parser.add_argument("--microbatch-options", default="1-64", metavar="LIST",
                        help="M values to try, e.g. 1-64 or 1,4,32 (default 1-64)")
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINT_POLICIES), help="policies to try")
    parser.add_argument("--schedules", default=None,
                        help=f"schedules to try (default with --costs: all of {', '.join(SCHEDULES)}; otherwise "
                             f"{', '.join(PLANNED_SCHEDULES)}: the split-backward ones only where calibration "
                             "measured what splitting costs; name them to search them)")
    space = parser.add_argument_group("replicas and interleaving (D x K devices at most the system's)")
    space.add_argument("--replicas-options", "--replicas", dest="replicas_options", default=None, metavar="LIST",
                       help="D values to try, data-parallel copies of the pipeline; --batch is the global batch "
                            "(default: powers of two up to the devices)")
    space.add_argument("--virtual-stages-options", "--virtual-stages", dest="virtual_options", default=None,
                       metavar="LIST", help="V values to try: 1 runs gpipe and 1f1b, 2 or more the interleaved "
                                            "schedule (default 1,2,4)")
    space.add_argument("--zero-options", "--zero", dest="zero_options", default="0", metavar="LIST",
                       help="ZeRO stages to try, 0 and/or 1 (1 only with D > 1; default 0: ZeRO-1 is timed like 0, "
                            "so ask for it where memory is short)")
    space.add_argument("--placements", default=",".join(PLACEMENTS),
                       help="placements to try where they differ (several nodes, D > 1, K > 1)")
    space.add_argument("--tensor-parallel-options", "--tensor-parallel", dest="tensor_parallel_options",
                       default=None, metavar="LIST",
                       help="T values to try, devices of one node per stage (the built-in transformer; default: "
                            "the powers of two up to a node that divide its heads and FFN width; 1 for other models)")
    add_sequence_parallel_argument(space)
    add_context_parallel_arguments(space)
    parser.add_argument("--partitioner", default="min_max", choices=("min_max", "variance"))
    parser.add_argument("--top", type=int, default=10, help="rows in the ranked table (default 10)")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the best plan to this file")
    parser.add_argument("--schedule-csv-out", default=None, metavar="FILE",
                        help="also write the best plan's schedule in torch.distributed.pipelining's CSV form "
                             "(one row of actions per rank, as its _load_csv reads)")
    parser.add_argument("--json", action="store_true", help="print the ranked plans as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr; only the result")
    cost = parser.add_argument_group("days and dollars")
    cost.add_argument("--train-tokens", default=None, metavar="N",
                      help="tokens to train on (15T, 300B, 2e12): each plan's days, device-hours and cost")
    cost.add_argument("--rank-by", choices=("time", "cost"), default="time",
                      help="rank plans by step time (default) or by cost: step time x devices x price")
    cost.add_argument("--price-per-device-hour", type=float, default=None, metavar="USD",
                      help="price of one device for an hour (default: the catalog's on-demand list price)")
    cost.add_argument("--max-devices", type=int, default=None, metavar="N",
                      help="use at most N devices (D x K x T x C); without --nodes, as many nodes as N needs")
    cost.add_argument("--max-cost", type=float, default=None, metavar="USD",
                      help="only plans whose training costs at most this much (needs --train-tokens)")
    cost.add_argument("--max-days", type=float, default=None, metavar="DAYS",
                      help="only plans that train in at most this many days (needs --train-tokens)")
    parser.add_argument("--list-models", action="store_true",
                        help="list the named models (--model llama3-70b, ...) with their shapes and sources, and exit")
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


def format_named_models() -> str:
    """One line per named model: its shape, parameters and where the figures come from."""
    from sim.workloads.models import get_workload
    from sim.workloads.named_models import named_models, named_options

    lines = [f"{'model':16} {'params':>8} {'layers':>6} {'d_model':>7} {'heads':>9} {'ff':>6} {'seq':>6}  source"]
    for name, model in named_models().items():
        o = named_options(name, {})
        billions = get_workload("transformer", o).parameter_count / 1e9
        heads = f"{o['heads']}/{o['kv_heads'] or o['heads']}"
        lines.append(f"{name:16} {billions:>7.1f}B {o['layers']:>6} {o['d_model']:>7} {heads:>9} {o['ff']:>6} "
                     f"{o['seq']:>6}  {model.source}")
    lines.append("heads: query/key-value heads; params of the built-in transformer of that shape (learned positions "
                 "and biases included); --option seq=N or a config field (num_hidden_layers=40) changes one")
    return "\n".join(lines)


def planning_inputs(args: argparse.Namespace, hardware: str | None = None):
    """The system (with any efficiency override), the model options and the precision, shared by
    both modes; ``hardware`` is one of the ``--hardware`` list (default the only one)."""
    from sim.planner.whatif import efficiency_from_costs, with_efficiency

    efficiency, bandwidth = args.efficiency, None
    if efficiency is not None and not 0.0 < efficiency <= 1.0:  # nan too
        raise GpipeInputError(f"--efficiency {efficiency} is not a fraction of peak; use a value in (0, 1]")
    if args.efficiency_from:
        fitted, bandwidth = efficiency_from_costs(args.efficiency_from)
        efficiency = fitted if efficiency is None else efficiency
    hardware = hardware or args.hardware
    system = with_efficiency(resolve_system(hardware, nodes_for(args, hardware)), efficiency, bandwidth)
    options = simulation_options(args)
    if args.input_shape:
        options["input_shape"] = args.input_shape
    options, attention_note = with_attention_default(model_name(args), options, system.device, args.costs)
    return system, options, chosen_precision(args, system.device), attention_note


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        print(format_named_models())
        return 0
    if args.precision is not None:
        check_precision(args.precision)
    check_output_path(args.out, "--out")
    check_output_path(args.schedule_csv_out, "--schedule-csv-out")
    check_output_path(args.html, "--html")
    hardware = hardware_list(args.hardware)
    costing = costing_of(args, hardware)
    if args.max_layers:
        if len(hardware) > 1:
            raise GpipeInputError("--max-layers takes one --hardware; give one system")
        from gpipe.max_layers import run as run_max_layers

        return run_max_layers(args, *planning_inputs(args))
    require_positive("--top", args.top)
    checkpoints = [check_checkpoint_policy(c) for c in args.checkpoints.split(",")]
    schedules = [check_schedule_name(s) for s in default_schedules(args).split(",")]
    placements = [check_placement(p) for p in args.placements.split(",")]
    inputs = [planning_inputs(args, name) for name in hardware]  # every system's precision checked first
    progress = _SearchBar() if bars_shown() else None
    wide = _wide_enough_to_fold(args, inputs, placements)
    planned = [_plan_on(wide, *given, checkpoints, schedules, placements, costing, progress) for given in inputs]
    if progress:
        progress.finish()
    fitting = [p for p in planned if p.result.best is not None]
    if not fitting and costing.limited and any(p.result.over_limit for p in planned):
        raise GpipeInputError(_nothing_within_limits(args, inputs, checkpoints, schedules, placements, costing))
    if not fitting:
        first = planned[0]
        raise GpipeInputError(_nothing_fits(first.result, first.workload, first.system, first.batch,
                                            first.stage_options, first.microbatch_options, checkpoints,
                                            first.schedules))
    ranked = sorted((o for p in fitting for o in p.result.ranked),
                    key=lambda o: (o.score, o.max_peak_memory_bytes, o.candidate.stages))
    rows = fold_placements(ranked, {p.system.name: p.system for p in planned})[:args.top]
    ranked = ranked[:args.top]
    best = ranked[0]
    fastest, cheapest = _fastest_and_cheapest(args, inputs, ranked, planned, checkpoints, schedules, placements,
                                              costing)
    home = next(p for p in planned if p.system.name == best.hardware)
    description = home.workload.describe()
    if args.out:
        plan = to_plan(best, description, home.batch, home.system.name, home.system.nodes,
                       planned_optimizer(args, home.workload), home.precision, args.dp_overlap)
        defined = system_record(hardware[[p.system.name for p in planned].index(home.system.name)])
        save_plan(replace(plan, **priced_with(args, {**plan.hardware, **defined})), args.out)
    if args.schedule_csv_out:
        from sim.schedules.schedule import build_schedule
        from sim.schedules.torch_schedule import write_schedule_csv

        c = best.candidate
        write_schedule_csv(build_schedule(c.stages, c.microbatches, c.schedule, c.checkpoint, c.virtual_stages),
                           args.schedule_csv_out)
    searched = SearchResult(ranked=ranked, candidates=sum(p.result.candidates for p in planned),
                            simulated=sum(p.result.simulated for p in planned),
                            not_fitting=sum(p.result.not_fitting for p in planned),
                            elapsed_s=sum(p.result.elapsed_s for p in planned),
                            over_limit=sum(p.result.over_limit for p in planned))
    if args.json:
        json.dump({"model": {k: description[k] for k in ("name", "options", "num_layers", "parameter_count")},
                   "parameter_count": description["parameter_count"], "precision": home.precision,
                   "candidates": searched.candidates, "simulated": searched.simulated,
                   "elapsed_s": searched.elapsed_s, "rank_by": costing.rank_by,
                   "limits": {"max_devices": costing.max_devices, "max_cost": costing.max_cost,
                              "max_days": costing.max_days, "over_limit": searched.over_limit},
                   "ranked": [_option_dict(o) for o in ranked],
                   "fastest": _option_dict(fastest) if fastest else None,
                   "cheapest": _option_dict(cheapest) if cheapest else None,
                   "hardware": {p.system.name: _hardware_dict(p, args, costing, _range_ends(args, planned, costing))
                                for p in planned},
                   "planned_from": getattr(home.workload, "planned_from", None)}, sys.stdout)
        print()
    else:
        _print_plans(args, planned, rows, searched, description, home, costing, fastest, cheapest)
        if args.out:
            print(f"plan written to {args.out}")
        if args.schedule_csv_out:
            print(f"schedule written to {args.schedule_csv_out} (torch.distributed.pipelining's CSV)")
    if args.html:
        from sim.planner.whatif import write_whatif_html

        write_whatif_html(home.workload, home.system, home.batch, home.stage_options, home.microbatch_options, best,
                          args.html)
        if not args.json:
            print(f"what-if curves written to {args.html}")
    return 0


def _fastest_and_cheapest(args: argparse.Namespace, inputs: list, ranked: list[PlanOption], planned: list,
                          checkpoints: list[str], schedules: list[str], placements: list[str], costing: "Costing"):
    """With --train-tokens, the fastest plan of all and the cheapest of the priced systems' (ranking by
    cost has them all priced, :func:`costing_of`): the ranking gives one, a second search (its best
    only) under the other objective the other."""
    priced = [given for given in inputs if price_of(given[0], costing) is not None]
    if costing.train_tokens is None or not priced:
        return (ranked[0], None) if costing.rank_by == "time" else (None, ranked[0])
    flipped = replace(costing, rank_by="cost" if costing.rank_by == "time" else "time")
    one = argparse.Namespace(**{**vars(args), "top": 1})
    again = [o for given in (priced if flipped.rank_by == "cost" else inputs)
             for o in _plan_on(one, *given, checkpoints, schedules, placements, flipped, None).result.ranked]
    other = min(again, key=lambda o: o.score) if again else None
    return (ranked[0], other) if costing.rank_by == "time" else (other, ranked[0])


def _wide_enough_to_fold(args: argparse.Namespace, inputs: list, placements: list[str]) -> argparse.Namespace:
    """``args`` asking each search for enough plans that, once plans equal but for placement share a
    row (:mod:`gpipe.plan_rows`), ``--top`` rows are left: placements differ only over several nodes."""
    if len(placements) < 2 or all(given[0].nodes == 1 for given in inputs):
        return args
    return argparse.Namespace(**{**vars(args), "top": args.top * len(placements)})


def _print_plans(args: argparse.Namespace, planned: list, rows: list[PlanRow], searched: SearchResult,
                 description: dict, home, costing: "Costing", fastest: PlanOption | None,
                 cheapest: PlanOption | None) -> None:
    """The ranked table, with several hardware kinds the best plan of each, then the notes
    (:mod:`gpipe.plan_notes`)."""
    days = costing.train_tokens is not None
    systems = ",".join(p.system.name for p in planned)
    bests = best_rows(planned, rows) if len(planned) > 1 else []
    print(format_table(rows, searched, description, systems, home.batch, home.precision, costing.active, days, bests))

    def efficiency(system) -> tuple[str, str]:
        kind = efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs)
        return kind, efficiency_text(system, kind, args.efficiency_from)

    notes = [home.attention_note, planned_from_note(home.workload), compiled_note(home.workload),
             *note_lines(planned, fastest, cheapest, costing.active, days, _range_ends(args, planned, costing),
                         efficiency, lambda system: (price_of(system, costing), price_source(system, costing)),
                         args.costs)]
    for note in notes:
        if note:
            print(note)


def _range_ends(args: argparse.Namespace, planned: list, costing: "Costing") -> RangeEnds:
    """A plan's days and dollars at both ends of an assumed efficiency's range (:mod:`sim.planner.efficiency_range`)."""
    def assumed(system) -> bool:
        return efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs) == "assumed"

    return RangeEnds(planned, assumed,
                     lambda option, p: plan_cost(option, p.workload, p.system, p.batch, p.precision, costing),
                     args.dp_overlap)


def _hardware_dict(planned, args: argparse.Namespace, costing: "Costing", ends: RangeEnds) -> dict:
    """``--json``'s entry for one hardware kind: what its efficiency and price rest on, its best plan
    and, for an assumed efficiency, that plan's days and dollars at both ends of the range."""
    system = planned.system
    kind = efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs)
    best = planned.result.best
    at_ends = ends(best)
    return {"nodes": system.nodes, "efficiency": kind, "efficiency_fraction": system.device.efficiency,
            "efficiency_range": list(ASSUMED_EFFICIENCY_RANGE) if kind == "assumed" else None,
            "price_per_device_hour": price_of(system, costing), "price_source": price_source(system, costing),
            "best": _option_dict(best) if best is not None else None,
            "best_at_efficiency_range": [o.cost.to_dict() for _, o in at_ends] if at_ends else None}


def _nothing_within_limits(args: argparse.Namespace, inputs: list, checkpoints: list[str], schedules: list[str],
                           placements: list[str], costing: "Costing") -> str:
    """Why no plan is left, with what the limits exclude: the fastest and the cheapest without them."""
    free = replace(costing, max_cost=None, max_days=None)
    one = argparse.Namespace(**{**vars(args), "top": 1})
    asked = " and ".join(text for text in (f"at most {costing.max_days:g} days" if costing.max_days else "",
                                           f"at most {dollars(costing.max_cost)}" if costing.max_cost else "") if text)
    best = {}
    for rank_by in ("time", "cost") if costing.max_cost else ("time",):
        found = [o for given in inputs for o in _plan_on(one, *given, checkpoints, schedules, placements,
                                                         replace(free, rank_by=rank_by), None).result.ranked]
        if found:
            best[rank_by] = min(found, key=lambda o: o.score)
    said = []
    if "time" in best:
        said.append(f"the fastest, {layout_text(best['time'])} on {best['time'].hardware}, takes "
                    f"{best['time'].cost.days:.3g} days")
    if "cost" in best:
        said.append(f"the cheapest, {layout_text(best['cost'])} on {best['cost'].hardware}, costs "
                    f"{dollars(best['cost'].cost.cost)}")
    return (f"no plan trains {format_token_count(costing.train_tokens)} tokens in {asked}: " + "; ".join(said or ["none fits"]) +
            "; raise the limits, allow more devices (--max-devices) or try other --hardware")


@dataclass
class _Planned:
    """One system's search and what its output needs."""

    system: Any
    workload: Any
    batch: int
    precision: str
    result: SearchResult
    attention_note: str | None
    stage_options: list[int]
    microbatch_options: list[int]
    schedules: list[str]


def _plan_on(args: argparse.Namespace, system, options: dict, precision: str, attention_note: str | None,
             checkpoints: list[str], schedules: list[str], placements: list[str], costing: "Costing",
             progress) -> _Planned:
    """The search on one system, its ranked plans costed (:mod:`sim.planner.training_cost`)."""
    space = search_space(args, system, schedules)
    by_shape = costing.train_tokens is not None or args.context_parallel > 1 or any(
        t > 1 for t in parse_int_list(args.tensor_parallel_options or "1", "--tensor-parallel-options"))
    workload, batch = workload_and_batch(args, options, precision, by_shape)
    checkpoints = policies_for(workload, checkpoints, args.checkpoints != ",".join(CHECKPOINT_POLICIES))
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
    check_space_fits(space, stage_options, microbatch_options, system, workload.num_layers)
    if hasattr(workload, "bind"):  # measured costs hold one fit per stage count (sim.formats.costs)
        if costing.active:
            raise GpipeInputError("--train-tokens, --rank-by cost, --max-devices and several --hardware plan the "
                                  "analytic models; drop --costs (use --efficiency-from COSTS for its fit)")
        check_context_parallel(args.context_parallel, workload, system)
        result = _search_each_tensor_parallel(workload, system, batch, tensor_parallel_options(args, workload, system),
                                              args.sequence_parallel, stage_options, microbatch_options, checkpoints,
                                              args, progress, space, placements)
    else:
        result = _search_each_tensor_parallel(workload, system, batch, tensor_parallel_options(args, workload, system),
                                              args.sequence_parallel, stage_options, microbatch_options, checkpoints,
                                              args, progress, space, placements, costing)
    for option in result.ranked:
        option.hardware = system.name
        option.cost = plan_cost(option, workload, system, batch, precision, costing) if costing.active else None
    return _Planned(system, workload, batch, precision, result, attention_note, stage_options, microbatch_options,
                    space["schedules"])


@dataclass(frozen=True)
class Costing:
    """What the days-and-dollars flags ask for."""

    train_tokens: float | None
    rank_by: str
    price_override: float | None
    max_devices: int | None
    max_cost: float | None
    several_systems: bool
    max_days: float | None = None

    @property
    def active(self) -> bool:
        return (self.train_tokens is not None or self.rank_by == "cost" or self.several_systems
                or self.max_devices is not None)

    @property
    def limited(self) -> bool:
        """Whether the search drops plans by days or dollars."""
        return self.max_cost is not None or self.max_days is not None

    def step_limit(self, tokens_per_step: float, devices_per_group: int, price: float | None):
        """Each candidate's longest step within --max-days and --max-cost (None: no limit): steps to
        train = tokens / tokens per step; days = steps x step / 86,400; cost = days x 24 x devices x price."""
        if not self.limited:
            return None
        steps = self.train_tokens / tokens_per_step
        by_days = self.max_days * SECONDS_PER_DAY / steps if self.max_days is not None else float("inf")

        def limit(c) -> float:
            if self.max_cost is None:
                return by_days
            devices = c.stages * c.replicas * devices_per_group
            return min(by_days, self.max_cost * 3600.0 / (steps * devices * price))

        return limit


def hardware_list(text: str) -> list[str]:
    """``--hardware a,b,c``: the systems to search, each checked (one line naming an unknown one)."""
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    if not names:
        raise GpipeInputError("--hardware is empty; give a system such as h100-nvlink, or several separated by commas")
    systems = [resolve_system(name).name for name in names]
    if len(set(systems)) != len(systems):
        raise GpipeInputError(f"--hardware {text!r} names a system twice; give each once")
    return names


def costing_of(args: argparse.Namespace, hardware: list[str]) -> Costing:
    """The days-and-dollars flags, checked before any work."""
    from sim.planner.training_cost import parse_token_count

    tokens = parse_token_count(args.train_tokens) if args.train_tokens is not None else None
    if args.max_devices is not None:
        require_positive("--max-devices", args.max_devices)
    if args.price_per_device_hour is not None and not args.price_per_device_hour > 0:
        raise GpipeInputError(f"--price-per-device-hour {args.price_per_device_hour} is not a positive price; "
                              "give dollars per device-hour, e.g. 2.5")
    if args.max_cost is not None:
        if tokens is None:
            raise GpipeInputError("--max-cost needs --train-tokens: the cost is that of training on them")
        if not args.max_cost > 0:
            raise GpipeInputError(f"--max-cost {args.max_cost} is not a positive amount")
    if args.max_days is not None:
        if tokens is None:
            raise GpipeInputError("--max-days needs --train-tokens: the days are those of training on them")
        if not args.max_days > 0:
            raise GpipeInputError(f"--max-days {args.max_days} is not a positive number of days")
    costing = Costing(tokens, args.rank_by, args.price_per_device_hour, args.max_devices, args.max_cost,
                      len(hardware) > 1, args.max_days)
    if args.rank_by == "cost" or args.max_cost is not None:
        unpriced = [name for name in hardware if price_of(resolve_system(name), costing) is None]
        if unpriced:
            raise GpipeInputError(f"{unpriced[0]} has no list price in the catalog; give --price-per-device-hour "
                                  "or drop it from --hardware")
    return costing


def nodes_for(args: argparse.Namespace, hardware: str) -> int:
    """``--nodes``, else as many nodes of ``hardware`` as ``--max-devices`` needs, else one."""
    if args.nodes is not None:
        return args.nodes
    if getattr(args, "max_devices", None):
        per_node = resolve_system(hardware).devices_per_node
        return max(1, -(-args.max_devices // per_node))
    return 1


def price_of(system, costing: Costing) -> float | None:
    return costing.price_override if costing.price_override is not None else system.price_per_device_hour


def price_source(system, costing: Costing) -> str:
    if costing.price_override is not None:
        return "--price-per-device-hour"
    return system.price_source or "no list price in the catalog"


def plan_cost(option: PlanOption, workload, system, batch: int, precision: str, costing: Costing):
    """The :class:`sim.planner.training_cost.TrainingCost` of a ranked plan."""
    from sim.workloads.precision import precision_of
    from sim.planner.training_cost import model_flops_per_token, training_cost

    c = option.candidate
    described = workload.describe()
    o = described.get("shape") or described["options"]  # a Hugging Face model's: the transformer's that prices it
    if "seq" not in o or "d_model" not in o:
        raise GpipeInputError(f"days and dollars count tokens: the model {described['name']} has no sequences; plan "
                              "the transformer, a named model (gpipe plan --list-models) or an hf: model")
    devices = c.stages * c.replicas * c.tensor_parallel * c.context_parallel
    peak = system.device.peak_flops[precision_of(precision).matmul_peak]
    return training_cost(option.step_time_s, batch * o["seq"], devices,
                         model_flops_per_token(o, described["parameter_count"]), peak, costing.train_tokens,
                         price_of(system, costing))


def default_schedules(args: argparse.Namespace) -> str:
    """``--schedules``, or the default: every schedule where measured costs (``--costs``) price the
    split backward's I, W and its own cost from the profile, else all but the split-backward ones,
    whose cost the analytic models (and a quick calibration, which leaves I and W out) do not know:
    they split a layer's backward in halves for free."""
    if args.schedules:
        return args.schedules
    return ",".join(SCHEDULES if splits_measured(getattr(args, "costs", None)) else PLANNED_SCHEDULES)


def splits_measured(costs_path: str | None) -> bool:
    """Whether the costs file at ``costs_path`` profiled each layer's I and W (False without one)."""
    if not costs_path:
        return False
    from sim.formats.costs import read_costs

    times = read_costs(costs_path).get("profile", {}).get("times_s", {})
    return bool(times) and all("W" in kinds for kinds in times.values())


def search_space(args: argparse.Namespace, system, schedules: list[str]) -> dict:
    """D, V and ZeRO values to search, and the schedules they leave; refused in one line where they
    cannot combine (V without the interleaved schedule, ZeRO-1 with one replica)."""
    replicas = (parse_int_list(args.replicas_options, "--replicas") if args.replicas_options
                else default_replica_options(system))
    virtual = parse_int_list(args.virtual_options, "--virtual-stages") if args.virtual_options else [1, 2, 4]
    zero = parse_zero_list(args.zero_options)
    interleaving = [v for v in virtual if v >= 2]
    if args.virtual_options and interleaving and not set(schedules) & set(MULTI_CHUNK_SCHEDULES):
        raise GpipeInputError(f"--virtual-stages {interleaving[0]} needs the interleaved schedule; add it to "
                              f"--schedules (e.g. --schedules {','.join(schedules)},interleaved)")
    if args.virtual_options and not interleaving and schedules == ["interleaved"]:
        raise GpipeInputError("--schedules interleaved needs --virtual-stages 2 or more")
    # V-shaped schedules run two chunks per device whatever --virtual-stages lists for the interleaved one
    kept = [s for s in schedules if (s == "interleaved" and interleaving) or s in V_SHAPED_SCHEDULES
            or (s != "interleaved" and 1 in virtual)]
    if not kept:
        raise GpipeInputError(f"--virtual-stages {args.virtual_options} leaves none of --schedules "
                              f"{','.join(schedules)}: V=1 runs gpipe and 1f1b, V >= 2 the interleaved schedule")
    if zero == [1] and replicas == [1]:
        raise GpipeInputError("--zero 1 shards optimizer state over the data-parallel group, which needs "
                              "--replicas 2 or more; use --zero 0 with one replica")
    return {"replicas": replicas, "virtual": virtual, "zero": zero, "schedules": kept,
            "replicas_given": bool(args.replicas_options)}


def parse_zero_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        if part.strip() not in ("0", "1"):
            raise GpipeInputError(f"--zero {text!r}: each value must be 0 or 1, e.g. --zero 0,1")
        values.append(int(part))
    return sorted(set(values))


def check_space_fits(space: dict, stage_options: list[int], microbatch_options: list[int], system,
                     num_layers: int) -> None:
    """D x K within the system's devices, and for the interleaved schedule alone V x K within the
    layers and M a multiple of K, for at least one K."""
    for d in space["replicas"] if space["replicas_given"] else ():  # defaults beyond the devices are skipped
        system.check_fits(min(stage_options), d)
    interleaving = [v for v in space["virtual"] if v >= 2]
    if interleaving and space["schedules"] == ["interleaved"]:
        deep = [k for k in stage_options if k > 1]
        if not deep:
            raise GpipeInputError("the interleaved schedule needs 2 stages or more; add them to --stages-options")
        if min(interleaving) * min(deep) > num_layers:
            v, k = min(interleaving), min(deep)
            raise GpipeInputError(f"{v} virtual stages x {k} stages = {v * k} chunks but the model has "
                                  f"{num_layers} layers; use fewer --virtual-stages or --stages-options")
        if not any(m % k == 0 for m in microbatch_options for k in deep):
            raise GpipeInputError(f"the interleaved schedule needs micro-batches (M) a multiple of stages (K), and no "
                                  f"--microbatch-options value is a multiple of any --stages-options value above 1; "
                                  f"use e.g. --microbatch-options {2 * min(deep)}")


def _search_each_stage_count(workload, system, batch: int, stage_options: list[int], microbatch_options: list[int],
                             checkpoints: list[str], schedules: list[str], partitioner: str, top: int,
                             progress, space: dict, placements: list[str]) -> SearchResult:
    """Search K by K and D by D with the measured workload bound to each (its fits and threads are
    those of D x K processes), then merge the rankings."""
    parts = []
    for k in stage_options:
        for d in space["replicas"]:
            bound, bound_system = workload.bind(system, k, replicas=d)
            parts.append(search(bound, bound_system, batch, [k], microbatch_options, checkpoints, schedules,
                                partitioner, top, progress, [d], space["virtual"], space["zero"],
                                placements, calibrated_allreduce(bound, bound_system)))
    return _merged(parts, top)


def policies_for(workload, checkpoints: list[str], asked: bool) -> list[str]:
    """The policies to search; ``selective`` asked for explicitly where the model has no attention
    core to recompute is refused in one line (by default :func:`sim.planner.search.search` leaves it out)."""
    if asked:
        for checkpoint in checkpoints:
            check_checkpoint_for(workload, checkpoint)
    return checkpoints


def tensor_parallel_options(args: argparse.Namespace, workload, system) -> list[int]:
    """``--tensor-parallel-options``, each checked; by default the powers of two up to a node that
    the model allows (T = 1 for models tensor parallelism is not modelled for, and on this machine's
    ``cpu`` system, whose cores share one memory: plans for it are what ``gpipe train`` runs here)."""
    if args.tensor_parallel_options:
        options = parse_int_list(args.tensor_parallel_options, "--tensor-parallel-options")
        for t in options:
            check_tensor_parallel(t, workload, system)
            check_context_parallel(args.context_parallel, workload, system, t)
        return options
    check_context_parallel(args.context_parallel, workload, system)
    if system.name == "cpu" or hasattr(workload, "bind"):  # measured costs: T = 1 unless asked
        return [1]
    options = []
    for t in (2 ** i for i in range(system.devices_per_node.bit_length())):
        try:
            check_tensor_parallel(t, workload, system)
            check_context_parallel(args.context_parallel, workload, system, t)
        except GpipeInputError:
            continue
        options.append(t)
    return options


def _search_each_tensor_parallel(workload, system, batch: int, tensor_options: list[int], sequence: bool | None,
                                 stage_options: list[int], microbatch_options: list[int], checkpoints: list[str],
                                 args: argparse.Namespace, progress, space: dict, placements: list[str],
                                 costing: "Costing | None" = None) -> SearchResult:
    """Search T by T, each on its split workload and its system of T-device groups, then merge the
    rankings (each exact, so the merged top is exact). Ranked by cost, each candidate's step is
    weighed by its devices and their price; ``--max-devices`` bounds D x K x T x C. Measured costs
    (a workload with ``bind``) are searched K by K and D by D inside each T."""
    parts = []
    price = price_of(system, costing) if costing is not None else None
    for t in tensor_options:
        devices_per_group = t * args.context_parallel
        weight = None
        if costing is not None and costing.rank_by == "cost":
            weight = (lambda c, g=devices_per_group: c.stages * c.replicas * g * price)
        max_groups = costing.max_devices // devices_per_group if costing and costing.max_devices else None
        if max_groups == 0:
            continue
        step_limit = (costing.step_limit(batch * workload.options["seq"], devices_per_group, price)
                      if costing is not None and costing.limited else None)
        sequence_parallel = default_sequence_parallel(t, sequence, workload) and t > 1
        split, groups = with_tensor_parallel(workload, system, t, sequence_parallel, args.context_parallel,
                                             calibrated_tensor_parallel_link(args, system, sequence_parallel))
        stages = [k for k in stage_options if k <= groups.total_devices]
        if not stages:
            continue
        if hasattr(split, "bind"):
            part = _search_each_stage_count(split, groups, batch, stages, microbatch_options, checkpoints,
                                            space["schedules"], args.partitioner, args.top, progress, space,
                                            placements)
        else:
            part = search(split, groups, batch, stages, microbatch_options, checkpoints, space["schedules"],
                          args.partitioner, args.top, progress, space["replicas"], space["virtual"], space["zero"],
                          placements, dp_overlap=args.dp_overlap, weight=weight, max_groups=max_groups,
                          step_limit_s=step_limit)
        for option in part.ranked + part.unfit_examples:
            option.candidate = replace(option.candidate, tensor_parallel=t, sequence_parallel=sequence_parallel,
                                       context_parallel=args.context_parallel)
        parts.append(part)
    return _merged(parts, args.top)


def calibrated_tensor_parallel_link(args: argparse.Namespace, system, sequence_parallel: bool):
    """The tensor-parallel collectives ``--efficiency-from COSTS`` measured, where the plan runs on
    the system they were measured on; else None (the catalog's node link)."""
    path = getattr(args, "efficiency_from", None)
    if not path:
        return None
    from sim.formats.costs import read_costs, tensor_parallel_link

    data = read_costs(path)
    return tensor_parallel_link(data, sequence_parallel) if system.name == data.get("system", "cpu") else None


def _merged(parts: list[SearchResult], top: int) -> SearchResult:
    ranked = sorted((o for part in parts for o in part.ranked),
                    key=lambda o: (o.score, o.max_peak_memory_bytes, o.candidate.stages))[:top]
    return SearchResult(ranked=ranked, candidates=sum(p.candidates for p in parts),
                        simulated=sum(p.simulated for p in parts), not_fitting=sum(p.not_fitting for p in parts),
                        elapsed_s=sum(p.elapsed_s for p in parts),
                        unfit_examples=[o for p in parts for o in p.unfit_examples][:5],
                        over_limit=sum(p.over_limit for p in parts))


def planned_optimizer(args: argparse.Namespace, workload) -> str:
    """``--optimizer``, else the one a costs file measured with, else the default."""
    from sim.workloads.optimizers import DEFAULT_OPTIMIZER

    return args.optimizer or getattr(workload, "optimizer", None) or DEFAULT_OPTIMIZER


def to_plan(option: PlanOption, description: dict, batch: int, system: str, nodes: int, optimizer: str,
            precision: str, dp_overlap: bool = False) -> Plan:
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
        predicted={**option.result.to_dict(),
                   **({"training": option.cost.to_dict()} if getattr(option, "cost", None) is not None else {})}, optimizer=optimizer, precision=precision,
        replicas=c.replicas, virtual_stages=c.virtual_stages, zero=c.zero, placement=c.placement,
        tensor_parallel=c.tensor_parallel, sequence_parallel=c.sequence_parallel,
        context_parallel=c.context_parallel, dp_overlap=dp_overlap,
    )


def priced_with(args: argparse.Namespace, hardware: dict) -> dict:
    """The plan's fields that say what it was priced with, so gpipe simulate --plan prices it alike:
    the costs file (path and hash) and the efficiencies given, applied as :func:`planning_inputs` does."""
    from dataclasses import asdict

    from sim.formats.plan import costs_ref
    from sim.planner.whatif import efficiency_from_costs

    hardware = dict(hardware)
    efficiency, bandwidth = args.efficiency, None
    if args.efficiency_from:
        fitted, bandwidth = efficiency_from_costs(args.efficiency_from)
        efficiency = fitted if efficiency is None else efficiency
        hardware["efficiency_from"] = asdict(costs_ref(args.efficiency_from))  # its tensor-parallel link too
    for name, value in (("efficiency", efficiency), ("bandwidth_efficiency", bandwidth)):
        if value is not None:
            hardware[name] = value
    return {"hardware": hardware, "costs": costs_ref(args.costs) if args.costs else None}


def _option_dict(option: PlanOption) -> dict:
    c = option.candidate
    assert option.result is not None
    # "stages" is the per-device list of results and "pipeline_stages" is K, as in gpipe simulate --json
    return {"microbatches": c.microbatches, "checkpoint": c.checkpoint,
            "schedule": c.schedule, "replicas": c.replicas, "virtual_stages": c.virtual_stages, "zero": c.zero,
            "placement": c.placement, "tensor_parallel": c.tensor_parallel,
            "sequence_parallel": c.sequence_parallel, "context_parallel": c.context_parallel,
            "partition": option.partition, "hardware": getattr(option, "hardware", None),
            "training": option.cost.to_dict() if getattr(option, "cost", None) is not None else None, **{
                k: v for k, v in option.result.to_dict().items()
                if k not in ("partition", "schedule", "checkpoint", "replicas", "virtual_stages", "zero", "placement")}}


def _nothing_fits(result: SearchResult, workload, system, batch: int, stage_options: list[int],
                  microbatch_options: list[int], checkpoints: list[str], schedules: list[str]) -> str:
    """Why nothing fits, told on the candidate that needs the least memory: most stages, most
    micro-batches, the most re-materialization searched."""
    from sim.engine.engine import simulate
    from sim.planner.search import Candidate, default_partition
    from sim.views.report import fit_advice

    order = ["full", "always", "selective", "except_last", "never"]  # the leanest first, as large models run
    policy = min(checkpoints, key=order.index)
    stages = max(stage_options)
    microbatches = len(split_rows(batch, max(microbatch_options)))
    if result.candidates == 0:
        return (f"no candidate to search: --schedules {','.join(schedules)} cannot run any K of "
                f"{','.join(map(str, stage_options))} on {workload.num_layers} layers (zbv and dualpipev need 2K "
                f"layers and K > 1, dualpipev M >= 2K, interleaved V x K layers and M a multiple of K); "
                f"give other --stages-options or add gpipe or 1f1b to --schedules")
    schedule = next((s for s in schedules if s not in MULTI_CHUNK_SCHEDULES), None)  # one chunk per device
    if schedule is None:
        return (f"no plan among {result.candidates} candidates fits; try more stages or "
                f"--checkpoints always, or --schedules with gpipe or 1f1b")
    candidate = Candidate(stages, microbatches, policy, schedule)
    partition = default_partition(workload, system, batch, candidate)
    leanest = simulate(workload, system, partition, batch, microbatches, policy, schedule, record=False)
    return (f"no plan among {result.candidates} candidates fits; even K={stages} M={microbatches} {policy}: "
            + fit_advice(leanest, system))


class _SearchBar:
    """One bar for the whole search: candidates examined (in order of promise) out of those in the
    space, and the fastest step so far. Each system's or replica count's search adds its candidates to
    the total as it starts; the search stops early once no candidate left can enter the ranking, so
    the bar closes at the count reached, below its total."""

    def __init__(self) -> None:
        self.bar = phase("searching plans", unit="plan")
        self.offset = self.total = self.done = 0
        self.best_s = float("inf")

    def __call__(self, done: int, total: int, best: PlanOption | None) -> None:
        if done < self.done or total != self.total:  # a new search began
            self.offset += self.done
            self.bar.total = (self.bar.total or 0) + total
            self.total = total
        self.done = done
        self.bar.update(self.offset + done - self.bar.n)
        if best is not None and best.step_time_s < self.best_s:
            self.best_s = best.step_time_s
            self.bar.set_postfix_str(f"fastest so far {self.best_s * 1e3:.3f} ms", refresh=False)

    def finish(self) -> None:
        self.bar.close()
