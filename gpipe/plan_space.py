"""``gpipe plan``'s flags turned into what the planner takes: a :class:`sim.planner.space.SearchSpace`
(the values to try, each hardware system with its model) and a :class:`sim.planner.training_cost.Costing`
(days and dollars, limits). Each flag is checked here, before any search, in one line.

The model of each system is resolved here, the composition root's job (:mod:`gpipe.workload_flags`:
a torch model is measured on the meta device, a costs file read): the planner gets workloads, never
flags.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Callable

from gpipe.options import (RENAMED_IN_PLAN, Renamed, add_context_parallel_arguments, add_sequence_parallel_argument,
                           check_output_path, hardware_of, parse_int_list, simulation_options)
from gpipe.workload_flags import chosen_precision, model_name, with_attention_default, workload_and_batch
from sim.catalog.hardware import Link, System
from sim.catalog.user_systems import resolve_system
from sim.engine.placement import check_placement
from sim.errors import GpipeInputError, require_positive
from sim.planner.space import SearchSpace, Target
from sim.planner.training_cost import Costing, price_of
from sim.schedules.schedule import CHECKPOINT_POLICIES, PLANNED_SCHEDULES, PRICED_ONLY_POLICIES, SCHEDULES, \
    check_checkpoint_policy, check_schedule_name


def add_search_space_arguments(parser: argparse.ArgumentParser) -> Any:
    """``gpipe plan``'s lists of values to try, each named ``FLAG-options`` after the single value's
    flag of ``gpipe simulate``; that flag itself is refused there in one line (:data:`gpipe.options.RENAMED_IN_PLAN`).
    Returns the group, for the flags plan adds to it."""
    from sim.engine.placement import PLACEMENTS

    parser.add_argument("--stages-options", default=None, metavar="LIST",
                        help="K values to try, e.g. 1,2,4,8 (default: powers of two up to devices and layers)")
    parser.add_argument("--microbatch-options", default="1-64", metavar="LIST",
                        help="M values to try, e.g. 1-64 or 1,4,32 (default 1-64)")
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINT_POLICIES), metavar="LIST",
                        help="policies to try")
    parser.add_argument("--schedules", default=None, metavar="LIST",
                        help=f"schedules to try (default with --costs: all of {', '.join(SCHEDULES)}; otherwise "
                             f"{', '.join(PLANNED_SCHEDULES)}: the split-backward ones only where calibration "
                             "measured what splitting costs; name them to search them)")
    space = parser.add_argument_group("replicas and interleaving (D x K devices at most the system's)")
    space.add_argument("--replicas-options", default=None, metavar="LIST",
                       help="D values to try, data-parallel copies of the pipeline; --batch is the global batch "
                            "(default: powers of two up to the devices)")
    space.add_argument("--virtual-stages-options", default=None, metavar="LIST",
                       help="V values to try: 1 runs gpipe and 1f1b, 2 or more the interleaved schedule (default 1,2,4)")
    space.add_argument("--zero-options", default="auto", metavar="LIST",
                       help="ZeRO stages to try where D > 1: 0 (whole replicas), 1 (optimizer state sharded), 2 (and "
                            "gradients), 3 (and parameters, FSDP); default auto: each layout at the least stage "
                            "that fits memory; a list such as 0,1,2,3 ranks every stage listed by time")
    space.add_argument("--shard-group-options", default=None, metavar="LIST",
                       help="with ZeRO-2/3, HSDP shard groups to try beside all replicas: shard within groups of N "
                            "replicas, replicate across them (each N dividing D; default none)")
    space.add_argument("--gradient-sync-options", default="auto", metavar="LIST",
                       help="with ZeRO-2/3, when gradients are reduce-scattered: step (once, after the last "
                            "micro-batch), microbatch (after each); default auto: the trainers' default only "
                            "(microbatch with one stage, step with a pipeline); step,microbatch ranks both")
    space.add_argument("--placements", default=",".join(PLACEMENTS), metavar="LIST",
                       help="placements to try where they differ (several nodes, D > 1, K > 1)")
    space.add_argument("--tensor-parallel-options", default=None, metavar="LIST",
                       help="T values to try, devices of one node per stage (the built-in transformer; default: "
                            "the powers of two up to a node that divide its heads and FFN width; 1 for other models)")
    space.add_argument("--expert-parallel-options", default="auto", metavar="LIST",
                       help="E values to try for a mixture of experts, each dividing its routed experts and T x C x D "
                            "(default auto: every such divisor; 1 for a model without experts)")
    space.add_argument("--expert-tensor-parallel-options", default="auto", metavar="LIST",
                       help="the experts' own TP degrees to try, E x ETP dividing T x C x D (default auto: 1 and T)")
    for old, (new, meaning) in RENAMED_IN_PLAN.items():
        space.add_argument(old, action=Renamed, renamed=new, meaning=meaning,
                           dest="renamed_" + old[2:].replace("-", "_"))
    add_sequence_parallel_argument(space)
    add_context_parallel_arguments(space)
    return space


def hardware_list(args: argparse.Namespace) -> list[str]:
    """``--hardware a,b,c`` (default :func:`gpipe.options.hardware_of`): the systems to search, each
    checked (one line naming an unknown one)."""
    text = hardware_of(args)
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    if not names:
        raise GpipeInputError("--hardware is empty; give a system such as h100-nvlink, or several separated by commas")
    systems = [resolve_system(name).name for name in names]
    if len(set(systems)) != len(systems):
        raise GpipeInputError(f"--hardware {text!r} names a system twice; give each once")
    return names


def check_outputs(args: argparse.Namespace) -> None:
    check_output_path(args.out, "--out")
    check_output_path(args.schedule_csv_out, "--schedule-csv-out")
    check_output_path(args.html, "--html")


def costing_of(args: argparse.Namespace, hardware: list[str]) -> Costing:
    """The days-and-dollars flags, checked before any work."""
    from sim.planner.training_cost import parse_token_count

    tokens = parse_token_count(args.train_tokens) if args.train_tokens is not None else None
    if args.max_devices is not None:
        require_positive("--max-devices", args.max_devices)
    if args.price_per_device_hour is not None and not args.price_per_device_hour > 0:
        raise GpipeInputError(f"--price-per-device-hour {args.price_per_device_hour} is not a positive price; "
                              "give dollars per device-hour, e.g. 2.5")
    for flag, value, what in (("--max-cost", args.max_cost, "the cost is that of training on them"),
                              ("--max-days", args.max_days, "the days are those of training on them")):
        if value is not None and tokens is None:
            raise GpipeInputError(f"{flag} needs --train-tokens: {what}")
        if value is not None and not value > 0:
            raise GpipeInputError(f"{flag} {value} is not a positive " + ("amount" if flag == "--max-cost"
                                                                         else "number of days"))
    costing = Costing(train_tokens=tokens, rank_by=args.rank_by, price_override=args.price_per_device_hour,
                      max_devices=args.max_devices, max_cost=args.max_cost, several_systems=len(hardware) > 1,
                      max_days=args.max_days)
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


def planning_inputs(args: argparse.Namespace, hardware: str) -> tuple[System, dict[str, Any], str, str | None]:
    """The system (nodes, any efficiency given), the model options, the precision chosen there and the
    line that says which attention kernel was defaulted, for both modes (the search, --max-layers)."""
    from sim.planner.whatif import efficiency_from_costs, with_efficiency

    efficiency, bandwidth = args.efficiency, None
    if efficiency is not None and not 0.0 < efficiency <= 1.0:  # nan too
        raise GpipeInputError(f"--efficiency {efficiency} is not a fraction of peak; use a value in (0, 1]")
    if args.efficiency_from:
        fitted, bandwidth = efficiency_from_costs(args.efficiency_from)
        efficiency = fitted if efficiency is None else efficiency
    system = with_efficiency(resolve_system(hardware, nodes_for(args, hardware)), efficiency, bandwidth)
    options = simulation_options(args)
    if args.input_shape:
        options["input_shape"] = args.input_shape
    options, attention_note = with_attention_default(model_name(args), options, system.device, args.costs)
    return system, options, chosen_precision(args, system.device), attention_note


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


def tensor_parallel_link(args: argparse.Namespace, system: System) -> Callable[[bool], Link | None]:
    """The tensor-parallel collectives ``--efficiency-from COSTS`` measured (by sequence parallelism
    on or off), where the plan runs on the system they were measured on; else None (the catalog's
    node link)."""
    path = args.efficiency_from

    def link(sequence_parallel: bool) -> Link | None:
        if not path:
            return None
        from sim.formats.costs import read_costs, tensor_parallel_link as measured

        data = read_costs(path)
        return measured(data, sequence_parallel) if system.name == data.get("system", "cpu") else None

    return link


def _zero_list(text: str) -> tuple[tuple[int, ...], bool]:
    """(the ZeRO stages searched, whether an unfit layout escalates): ``auto`` starts at 0 and tries
    the next stage where a layout does not fit; a list searches those stages, ranked by time."""
    if text.strip() == "auto":
        return (0,), True
    values = []
    for part in text.split(","):
        if part.strip() not in ("0", "1", "2", "3"):
            raise GpipeInputError(f"--zero-options {text!r}: give auto, or ZeRO stages 0 to 3 separated by commas, "
                                  "e.g. --zero-options 0,1,2,3")
        values.append(int(part))
    return tuple(sorted(set(values))), False


def _gradient_sync_list(text: str) -> tuple[str | None, ...]:
    """``auto`` (the trainers' default alone: None), or the syncs listed, each step or microbatch."""
    from sim.formats.layout import GRADIENT_SYNCS

    if text.strip() == "auto":
        return (None,)
    values = {part.strip() for part in text.split(",")}
    if not values <= set(GRADIENT_SYNCS):
        raise GpipeInputError(f"--gradient-sync-options {text!r}: give auto, or step, microbatch or both separated "
                              "by a comma, e.g. --gradient-sync-options step,microbatch")
    return tuple(s for s in GRADIENT_SYNCS if s in values)


def _auto_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``auto`` (None: the planner's default) or the listed positive integers."""
    return None if text is None or text.strip() == "auto" else tuple(parse_int_list(text, flag))


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    return tuple(parse_int_list(text, flag)) if text else None


def search_space_of(args: argparse.Namespace, hardware: list[str],
                    costing: Costing) -> tuple[SearchSpace, dict[str, str | None]]:
    """The space the flags name, every system's model resolved, and each system's attention line."""
    checkpoints = tuple(check_checkpoint_policy(c) for c in args.checkpoints.split(","))
    for checkpoint in checkpoints:
        if checkpoint in PRICED_ONLY_POLICIES:
            raise GpipeInputError(f"--checkpoints {checkpoint}: priced by gpipe simulate and replay for what-if and "
                                  "published runs, not planned (gpipe train does not run it); choose among "
                                  f"{', '.join(CHECKPOINT_POLICIES)}")
    schedules = tuple(check_schedule_name(s) for s in default_schedules(args).split(","))
    placements = tuple(check_placement(p) for p in args.placements.split(","))
    inputs = [planning_inputs(args, name) for name in hardware]  # every system's precision checked first
    space = SearchSpace(
        hardware=(), stages=_int_list(args.stages_options, "--stages-options"),
        microbatches=tuple(parse_int_list(args.microbatch_options, "--microbatch-options")),
        checkpoints=None if args.checkpoints == ",".join(CHECKPOINT_POLICIES) else checkpoints,
        schedules=schedules, replicas=_int_list(args.replicas_options, "--replicas-options"),
        virtual_stages=_int_list(args.virtual_stages_options, "--virtual-stages-options"),
        zero=_zero_list(args.zero_options)[0], zero_escalates=_zero_list(args.zero_options)[1], placements=placements,
        shard_groups=_int_list(args.shard_group_options, "--shard-group-options") or (),
        gradient_syncs=_gradient_sync_list(args.gradient_sync_options),
        tensor_parallel=_int_list(args.tensor_parallel_options, "--tensor-parallel-options"),
        context_parallel=args.context_parallel, sequence_parallel=args.sequence_parallel,
        partitioner=args.partitioner, dp_overlap=args.dp_overlap,
        expert_parallel=_auto_list(args.expert_parallel_options, "--expert-parallel-options"),
        expert_tensor_parallel=_auto_list(args.expert_tensor_parallel_options, "--expert-tensor-parallel-options"))
    by_shape = costing.train_tokens is not None or space.splits_by_shape
    targets, notes = [], {}
    for system, options, precision, note in inputs:
        workload, batch = workload_and_batch(args, options, precision, by_shape)
        targets.append(Target(system, workload, batch, precision, tensor_parallel_link(args, system)))
        notes[system.name] = note
    return replace(space, hardware=tuple(targets)), notes


def searched_top(top: int, space: SearchSpace) -> int:
    """Plans to ask each search for, so that ``top`` rows are left once plans equal but for their
    placement share a row (:mod:`gpipe.plan_rows`): placements differ only over several nodes."""
    if len(space.placements) < 2 or all(target.system.nodes == 1 for target in space.hardware):
        return top
    return top * len(space.placements)
