"""``gpipe plan``: search for the fastest plan that fits, print a ranked table, write the plan file.

The flags become a :class:`sim.planner.space.SearchSpace` and a :class:`sim.planner.training_cost.Costing`
(:mod:`gpipe.plan_space`), the planner searches them (:func:`sim.planner.plan_search.search_plans`), and
what was asked for is written and printed (:mod:`gpipe.plan_output`). ``--max-layers`` asks another
question of the same model and system (:mod:`gpipe.max_layers`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from gpipe.options import (Checked, add_batch_argument, add_hardware_arguments, add_html_argument, add_json_argument,
                           add_model_arguments, add_optimizer_argument, add_out_argument, add_partitioner_argument,
                           add_precision_argument, one_of, add_compile_argument)
from gpipe.plan_output import (SearchBar, format_named_models, named_model_rows, planned_optimizer, print_json,
                               print_plans, priced_with, to_plan)
from gpipe.plan_rows import fold_placements
from gpipe.plan_space import (add_search_space_arguments, check_outputs, costing_of, hardware_list, planning_inputs,
                              search_space_of, searched_top)
from sim.errors import GpipeInputError, require_positive
from sim.catalog.user_systems import system_record
from sim.formats.plan import save_plan
from sim.planner.plan_search import fastest_and_cheapest, search_plans
from sim.views.progress import bars_shown
from sim.workloads.precision import check_precision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_optimizer_argument(parser)
    add_hardware_arguments(parser, several=True)
    parser.set_defaults(nodes=None)  # one, or as many as --max-devices needs (gpipe.plan_space.nodes_for)
    add_precision_argument(parser, "the costs file's; else the device's: bf16 on A100, H100, H200 and "
                                   "TPUs, fp32 elsewhere")
    add_compile_argument(parser)
    add_batch_argument(parser)
    add_search_space_arguments(parser)
    add_partitioner_argument(parser)
    parser.add_argument("--top", type=int, default=10, help="rows in the ranked table (default 10)")
    add_out_argument(parser, "write the best plan to this file")
    parser.add_argument("--schedule-csv-out", default=None, metavar="FILE",
                        help="also write the best plan's schedule in torch.distributed.pipelining's CSV form "
                             "(one row of actions per rank, as its _load_csv reads)")
    add_json_argument(parser, "print the ranked plans as one JSON object")
    cost = parser.add_argument_group("days and dollars")
    cost.add_argument("--train-tokens", default=None, metavar="N",
                      help="tokens to train on (15T, 300B, 2e12): each plan's days, device-hours and cost")
    cost.add_argument("--rank-by", default="time", action=Checked, check=one_of("--rank-by", ("time", "cost")),
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
    add_html_argument(whatif, "write step time, bubble and memory against K and M, and the best plan's timeline, "
                              "as HTML")


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        if args.json:
            json.dump({"models": named_model_rows()}, sys.stdout)
            print()
        else:
            print(format_named_models())
        return 0
    if args.precision is not None:
        check_precision(args.precision)
    check_outputs(args)
    hardware = hardware_list(args)
    costing = costing_of(args, hardware)
    if args.max_layers:
        if len(hardware) > 1:
            raise GpipeInputError("--max-layers takes one --hardware; give one system")
        from gpipe.max_layers import run as run_max_layers

        return run_max_layers(args, *planning_inputs(args, hardware[0]))
    require_positive("--top", args.top)
    space, attention_notes = search_space_of(args, hardware, costing)
    progress = SearchBar() if bars_shown() else None
    try:
        found = search_plans(space, costing, searched_top(args.top, space), progress)
    finally:
        if progress:
            progress.finish()
    rows = fold_placements(found.ranked, {p.system.name: p.system for p in found.planned})[:args.top]
    ranked = found.ranked[:args.top]
    best = ranked[0]
    fastest, cheapest = fastest_and_cheapest(space, costing, ranked)
    home = next(p for p in found.planned if p.system.name == best.hardware)
    if args.out:
        plan = to_plan(best, home.workload.describe(), home.batch, home.system.name, home.system.nodes,
                       planned_optimizer(args, home.workload), home.precision, args.dp_overlap)
        defined = system_record(hardware[[p.system.name for p in found.planned].index(home.system.name)])
        save_plan(replace(plan, **priced_with(args, {**plan.hardware, **defined})), args.out)
    if args.schedule_csv_out:
        from sim.schedules.schedule import build_schedule
        from sim.schedules.torch_schedule import write_schedule_csv

        c = best.candidate
        write_schedule_csv(build_schedule(c.stages, c.microbatches, c.schedule, c.checkpoint, c.virtual_stages),
                           args.schedule_csv_out)
    searched = found.totals(ranked)
    if args.json:
        print_json(args, found, ranked, searched, home, costing, fastest, cheapest)
    else:
        print_plans(args, found, rows, searched, home, costing, fastest, cheapest, attention_notes[home.system.name])
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
