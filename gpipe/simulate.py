"""``gpipe simulate``: predict one plan's step time, bubble, memory and timeline."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from gpipe.options import (add_compile_argument, add_hardware_arguments, add_html_argument, add_json_argument, add_model_arguments,
                           add_optimizer_argument, add_partitioner_argument, add_pipeline_arguments, add_plan_argument,
                           add_precision_argument, add_scale_out_arguments, add_trace_argument, check_output_path,
                           check_zero, hardware_of, simulation_options, virtual_stages_of)
from sim.catalog.hardware import Link, System
from sim.catalog.user_systems import resolve_system
from sim.engine.engine import SimResult, simulate
from sim.formats.layout import ParallelLayout, check_chunked_partition, check_expert_grid
from sim.engine.placement import check_placement
from sim.errors import GpipeInputError, require_positive
from sim.formats.costs import measured_precision, read_costs
from sim.formats.plan import Plan, costs_ref, costs_ref_from_dict, load_plan, parse_partition, recorded_costs_path
from sim.planner.search import default_partition
from sim.workloads.optimizers import optimizer_slots
from sim.workloads.precision import check_precision, choose_precision
from sim.schedules.schedule import (build_schedule, check_checkpoint_policy, check_interleaving, check_schedule_name,
                                    check_v_schedule, check_virtual_stages, format_grid)
from sim.catalog.efficiency_note import efficiency_kind, efficiency_text, uncalibrated_note
from sim.views.report import fit_advice, format_summary
from sim.workloads.tensor_parallel import (check_context_parallel, check_tensor_parallel, default_sequence_parallel,
                                           with_tensor_parallel)
from sim.planner.whatif import with_efficiency
from sim.workloads.moe.expert_parallel import with_expert_parallel
from sim.workloads.workload import Workload, check_checkpoint_for
from gpipe.workload_flags import (calibrated_allreduce, chosen_precision, compiled_note, model_name, planned_from_note,
                                  resolve_workload, with_attention_default, with_precision, workload_and_batch)


DEFAULT_STAGES = 4  # K when neither --stages nor --partition gives it, or the system's devices if fewer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_argument(parser, "simulate this plan file, on its hardware and priced with the costs file it records "
                              "(--costs FILE overrides it; the model, layout and hardware flags are ignored)")
    add_model_arguments(parser)
    add_optimizer_argument(parser)
    add_pipeline_arguments(parser, stages=f"{DEFAULT_STAGES} or the system's devices if fewer, or the --partition's "
                                          "entries over V")
    add_scale_out_arguments(parser)
    add_hardware_arguments(parser)
    add_precision_argument(parser, "the plan's; else the costs file's; else the device's: bf16 on "
                                   "A100, H100, H200 and TPUs, fp32 elsewhere")
    add_compile_argument(parser)
    add_partitioner_argument(parser)
    add_json_argument(parser)
    add_trace_argument(parser)
    add_html_argument(parser, "write a plotly timeline")
    parser.add_argument("--print-schedule", action="store_true",
                        help="print each device's action list (F forward, R recompute, B backward, I input "
                             "gradient, W weight gradients; stage, kind, micro-batch) before the result")
    parser.add_argument("--schedule-csv", default=None, metavar="FILE",
                        help="simulate the schedule in FILE, torch.distributed.pipelining's CSV (one row of "
                             "actions per rank, as its _dump_csv writes and _load_csv reads): K, V and M are the "
                             "file's")
    parser.add_argument("--allow-overflow", action="store_true",
                        help="report a plan that does not fit memory instead of failing")


def run(args: argparse.Namespace) -> int:
    if args.precision is not None:
        check_precision(args.precision)
    check_output_path(args.trace, "--trace")
    check_output_path(args.html, "--html")
    simulated = simulate_plan(args) if args.plan else simulate_from_flags(args)
    result, system, workload, precision, note = simulated
    if not result.fits and not args.allow_overflow:
        raise GpipeInputError(fit_advice(result, system))
    emit(result, system, workload, precision, args, note)
    return 0


def simulate_plan(args: argparse.Namespace) -> tuple[SimResult, System, Workload, str, str | None]:
    """``gpipe simulate --plan``: :func:`predict_plan` with the command's --costs, --precision and
    --dp-overlap."""
    plan = load_plan(args.plan)
    args.costs = plan_costs_path(plan, args.plan, args.costs)  # what priced it, for --json as for the plan
    return predict_plan(plan, args.plan, args.costs, args.precision, args.dp_overlap)


def plan_costs_path(plan: Plan, plan_path: str, costs: str | None) -> str | None:
    """``costs`` where given, else where the costs file the plan records is now (one line when it is
    missing or changed), else None: the plan was priced with the catalog."""
    if costs is not None or plan.costs is None:
        return costs
    fix = (f"re-plan (gpipe plan --costs {{path}} ... --out {plan_path}), or pass --costs {{path}} to simulate "
           "with those costs instead (the step may then differ from the plan's)")
    return recorded_costs_path(plan.costs, f"plan {plan_path}", fix)


def predict_plan(plan: Plan, plan_path: str, costs: str | None = None, precision: str | None = None,
                 dp_overlap: bool = False) -> tuple[SimResult, System, Workload, str, str | None]:
    """The plan's run (read from ``plan_path``), priced as the plan was: with the costs file it
    records (checked to be the same bytes) and its hardware's efficiencies, so the step is the
    plan's. An explicit ``costs`` wins, and the note returned says where the step differs from the
    plan's."""
    costs = plan_costs_path(plan, plan_path, costs)
    hardware = plan.hardware
    system = with_efficiency(resolve_system(hardware.get("definition") or hardware.get("system", "ideal"),
                                            int(hardware.get("nodes", 1)), where="plan's hardware"),
                             hardware.get("efficiency"), hardware.get("bandwidth_efficiency"))
    measured = measured_precision(read_costs(costs)) if costs else None
    # a plan records the precision it priced; a --precision given here means what it means for the model
    precision = (choose_precision(precision, system.device, measured, plan.model.name) if precision else
                 choose_precision(plan.precision, system.device, measured))
    options = {"optimizer_slots": optimizer_slots(plan.optimizer), **plan.model.options}
    workload = resolve_workload(plan.model.name, with_precision(plan.model.name, options, precision, costs),
                                costs)
    if workload.measured_costs:  # fits for this K, fitted link (sim.formats.costs)
        workload, system = workload.bind(system, plan.layout.stages, plan.layout.checkpoint, plan.layout.microbatches, plan.layout.replicas)
    check_tensor_parallel(plan.layout.tensor_parallel, workload, system)
    check_context_parallel(plan.layout.context_parallel, workload, system, plan.layout.tensor_parallel)
    system.check_fits(plan.layout.stages, plan.layout.replicas, plan.layout.tensor_parallel * plan.layout.context_parallel)
    tp_link = plan_tensor_parallel_link(plan, system, plan_path)
    physical = system
    workload, system = with_tensor_parallel(workload, system, plan.layout.tensor_parallel, plan.layout.sequence_parallel,
                                            plan.layout.context_parallel, tp_link)
    workload = with_expert_parallel(workload, physical, plan.layout.expert_parallel, plan.layout.expert_tensor_parallel,
                                    plan.layout.schedule)
    check_checkpoint_for(workload, plan.layout.checkpoint)
    result = simulate(workload, system, plan.partition, plan.batch_size, plan.layout,
                      allreduce_link=calibrated_allreduce(workload, system), dp_overlap=dp_overlap or plan.dp_overlap)
    return result, system, workload, precision, plan_step_note(plan, result.step_time_s, costs)


def plan_tensor_parallel_link(plan: Plan, system: System, plan_path: str) -> Link | None:
    """The tensor-parallel collectives the plan's ``--efficiency-from`` costs file measured, where
    they priced it (T > 1 on the system they were measured on); else None, the catalog's node link."""
    recorded = costs_ref_from_dict(plan.hardware.get("efficiency_from"), "hardware efficiency_from")
    if plan.layout.tensor_parallel == 1 or recorded is None:
        return None
    from sim.formats.costs import read_costs, tensor_parallel_link

    path = recorded_costs_path(recorded, f"plan {plan_path} (--efficiency-from)",
                               f"re-plan (gpipe plan --efficiency-from {{path}} ... --out {plan_path})")
    data = read_costs(path)
    return tensor_parallel_link(data, plan.layout.sequence_parallel) if system.name == data.get("system", "cpu") else None


def plan_step_note(plan: Plan, step_time_s: float, costs_path: str | None) -> str | None:
    """One line where this simulation is not priced like the plan: --costs in place of the costs
    file it records, or a step that differs from its predicted one by half a microsecond or more."""
    planned_s = plan.predicted.get("step_time_s")
    used = costs_ref(costs_path) if costs_path else None
    overridden = plan.costs is not None and (used is None or used.sha256 != plan.costs.sha256)
    if planned_s is None or (not overridden and abs(step_time_s - planned_s) < 0.5e-6):
        return None
    priced = f"costs file {plan.costs.path}" if plan.costs else "no costs file recorded"
    here = f"--costs {used.path}" if used else "the catalog's models"
    advice = ("; if it was priced with a costs file, pass it with --costs or re-plan"
              if plan.costs is None and used is None else "")
    return (f"note: the plan predicted {planned_s * 1e3:.3f} ms ({priced}); this simulation, with {here}, gives "
            f"{step_time_s * 1e3:.3f} ms{advice}")


def simulate_from_flags(args: argparse.Namespace) -> tuple[SimResult, System, Workload, str, str | None]:
    """Validate every flag before simulating, then run the simulation."""
    given = None
    if args.schedule_csv:
        from sim.schedules.torch_schedule import read_schedule_csv, schedule_shape

        check_checkpoint_policy(args.checkpoint)
        given, args.microbatches, args.virtual_stages = read_schedule_csv(args.schedule_csv, args.checkpoint)
        args.stages, args.schedule = len(given), schedule_shape(given, args.virtual_stages)
    stages_given = args.stages
    system = resolve_system(hardware_of(args), args.nodes)
    if args.stages is None:
        args.stages = min(DEFAULT_STAGES, system.total_devices)
    require_positive("stages (K)", args.stages, "use --stages 1 or more")
    require_positive("micro-batches (M)", args.microbatches, "use --microbatches 1 or more")
    require_positive("replicas (D)", args.replicas, "use --replicas 1 or more")
    check_checkpoint_policy(args.checkpoint)
    check_schedule_name(args.schedule)
    virtual = virtual_stages_of(args)
    check_virtual_stages(args.schedule, virtual)
    check_placement(args.placement)
    check_zero(args.zero, args.replicas, args.shard_group, args.gradient_sync)
    partition = parse_partition(args.partition) if args.partition is not None else None
    if partition is not None:
        check_chunked_partition(partition, virtual, "--partition")
    if partition is not None and stages_given is not None and len(partition) != stages_given * virtual:
        raise GpipeInputError(f"--partition has {len(partition)} entries but --stages {stages_given} x "
                              f"--virtual-stages {virtual} needs {stages_given * virtual}; drop --stages or make "
                              "them agree")
    stages = len(partition) // virtual if partition is not None else args.stages
    precision = chosen_precision(args, system.device)
    by_shape = args.tensor_parallel > 1 or args.context_parallel > 1  # hf: models split by their shape
    options, attention_note = with_attention_default(model_name(args), simulation_options(args), system.device,
                                                     args.costs)
    workload, batch = workload_and_batch(args, options, precision, by_shape)
    check_tensor_parallel(args.tensor_parallel, workload, system)
    check_context_parallel(args.context_parallel, workload, system, args.tensor_parallel)
    check_checkpoint_for(workload, args.checkpoint)
    system.check_fits(stages, args.replicas, args.tensor_parallel * args.context_parallel)
    check_expert_grid(args.expert_parallel, args.expert_tensor_parallel, args.tensor_parallel, args.context_parallel,
                      args.replicas)
    physical = system
    workload, system = with_tensor_parallel(workload, system, args.tensor_parallel,
                                            default_sequence_parallel(args.tensor_parallel, args.sequence_parallel, workload),
                                            args.context_parallel)
    workload = with_expert_parallel(workload, physical, args.expert_parallel, args.expert_tensor_parallel,
                                    args.schedule)
    if args.schedule == "interleaved":
        check_interleaving(stages, args.microbatches, virtual, workload.num_layers)
    if given is None:
        check_v_schedule(args.schedule, stages, args.microbatches)
    if workload.measured_costs:  # fits for this K, fitted link (sim.formats.costs)
        workload, system = workload.bind(system, stages, args.checkpoint, args.microbatches, args.replicas)
    if partition is None:
        if stages * virtual > workload.num_layers:
            raise GpipeInputError(
                f"{stages * virtual} stages for a model of {workload.num_layers} layers leaves a stage empty; "
                f"use --stages {workload.num_layers // virtual} or fewer")
        candidate = ParallelLayout(stages, args.microbatches, args.checkpoint, args.schedule, args.replicas, virtual,
                                   args.zero, args.placement, shard_group=args.shard_group,
                                   gradient_sync=args.gradient_sync,
                                   expert_parallel=args.expert_parallel,
                                   expert_tensor_parallel=args.expert_tensor_parallel)
        partition = default_partition(workload, system, batch, candidate, args.partitioner)
    layout = ParallelLayout.for_partition(partition, args.microbatches, args.checkpoint, args.schedule,
                                          virtual_stages=virtual, replicas=args.replicas, zero=args.zero,
                                          placement=args.placement, shard_group=args.shard_group,
                                          gradient_sync=args.gradient_sync,
                                          expert_parallel=args.expert_parallel,
                                          expert_tensor_parallel=args.expert_tensor_parallel)
    result = simulate(workload, system, partition, batch, layout, allreduce_link=calibrated_allreduce(workload, system),
                      dp_overlap=args.dp_overlap, actions=given)
    return result, system, workload, precision, attention_note


def assumed_efficiency_note(system: System) -> str | None:
    """One line where an accelerator's efficiency is the catalog's assumption, not a fit."""
    if system.device.kernels is not None or system.name in ("cpu", "ideal"):
        return None
    return (f"efficiency: assumed, {system.device.efficiency:.0%} of {system.device.name}'s peak FLOP/s and "
            f"{system.device.bandwidth_efficiency:.0%} of its memory bandwidth (no published run of it has been fitted)")


def error_band(result: SimResult, system: System, precision: str, experts: bool = False) -> dict | None:
    """The spread of the replayed published runs behind this device and regime, of its mixtures of
    experts with ``experts`` (None off accelerators)."""
    from sim.evidence.error_bands import band_field

    stages = len([stage for stage in result.stages if stage.replica == 0])
    return band_field(system.name, system.device.name, precision, stages, experts=experts)


def recorded_efficiency(args: argparse.Namespace) -> tuple[float | None, str | None]:
    """(efficiency, the costs file it was calibrated from) a simulated plan file was priced at; (None,
    None) without a plan or where the plan used the catalog's."""
    if not args.plan:
        return None, None
    hardware = load_plan(args.plan).hardware
    return hardware.get("efficiency"), (hardware.get("efficiency_from") or {}).get("path")


def emit(result: SimResult, system: System, workload: Workload, precision: str,
         args: argparse.Namespace, note: str | None = None) -> None:
    if args.trace:
        result.timeline.write_chrome_trace(args.trace)
    if args.html:
        from sim.views.figures import timeline_figure, write_html

        write_html(timeline_figure(result.timeline, title=f"Simulated step on {system.name}"), args.html)
    if args.json:
        data = result.to_dict()
        data["precision"] = precision
        data["hardware"] = {"system": system.name, "nodes": system.nodes * system.nodes_per_device}
        data["tensor_parallel"] = workload.tensor_parallel
        data["sequence_parallel"] = workload.sequence_parallel
        data["context_parallel"] = workload.context_parallel
        split = workload.experts_split
        if split is not None:  # only where set: outputs without expert parallelism stay as they were
            data["expert_parallel"] = split.expert_parallel
            data["expert_tensor_parallel"] = split.expert_tensor_parallel
        described = workload.describe()
        data["model"] = {k: described[k] for k in ("name", "options", "num_layers", "parameter_count")}
        data["parameter_count"] = described["parameter_count"]
        data["planned_from"] = workload.planned_from
        data["efficiency"] = efficiency_kind(system, *recorded_efficiency(args), args.costs)
        data["error_band"] = error_band(result, system, precision, workload.has_experts)
        data["costs"] = asdict(costs_ref(args.costs)) if args.costs else None  # what priced it, as a plan records
        if args.plan:
            data["plan_note"] = note  # None where the step is the plan's, priced alike
        json.dump(data, sys.stdout)
        print()
    else:
        if args.schedule_csv:
            print(f"schedule     from {args.schedule_csv}: K={args.stages}, "
                  f"V={result.virtual_stages}, M={args.microbatches}")
        if args.print_schedule:
            devices = len([stage for stage in result.stages if stage.replica == 0])
            if args.schedule_csv:
                from sim.schedules.torch_schedule import read_schedule_csv

                print(format_grid(read_schedule_csv(args.schedule_csv, args.checkpoint)[0]))
            else:
                print(format_grid(build_schedule(devices, args.microbatches, args.schedule, args.checkpoint,
                                                 result.virtual_stages)))
        print(format_summary(result, system, precision))
        band = error_band(result, system, precision, workload.has_experts)
        if band:
            print(f"error band   {result.step_time_s:.4g} s, {band['text']}")
        given, calibrated_from = recorded_efficiency(args)
        kind = efficiency_kind(system, given, calibrated_from, args.costs)
        efficiency = (assumed_efficiency_note(system) if kind == "assumed" else
                      efficiency_text(system, kind, calibrated_from) if kind in ("given", "calibrated") else
                      uncalibrated_note(system, workload, result.batch_size, args.costs))
        for line in (note, planned_from_note(workload), compiled_note(workload), efficiency):
            if line:
                print(line)
        tensor_parallel = workload.tensor_parallel
        if tensor_parallel > 1:
            sequence = "on" if workload.sequence_parallel else "off"
            print(f"tensor parallel T={tensor_parallel} (sequence parallel {sequence}): each stage is {tensor_parallel} "
                  "devices of one node; memory and busy time are one device's")
        context_parallel = workload.context_parallel
        if context_parallel > 1:
            where = ("the node" if system.nodes_per_device == 1 else
                     f"{system.nodes_per_device} nodes, its ring on the inter-node link")
            print(f"context parallel C={context_parallel}: each sequence split over {context_parallel} devices of "
                  f"{where} ({tensor_parallel * context_parallel} per stage); memory and busy time are one device's")
        split = workload.experts_split
        if split is not None:
            where = ("inside one node (scale-up domain)" if split.per_domain == split.expert_parallel else
                     f"{split.per_domain} per scale-up domain, the rest over the inter-node link")
            overlap = "hidden behind another micro-batch's compute where it can be" if split.overlapped else "shown whole"
            measured = workload.experts  # a costs file's: sim.formats.measured_experts
            if measured is not None:
                where = ("on the costs file's fitted all-to-all" if measured.link is not None
                         else "on the catalog's links (the costs file fitted no all-to-all)")
                overlap = "shown whole, as the executor runs them"
            print(f"expert parallel E={split.expert_parallel} (ETP {split.expert_tensor_parallel}): each MoE layer's "
                  f"experts split over {split.expert_parallel} ranks, {where}; its all-to-alls {overlap}")
        for flag, path in (("trace", args.trace), ("timeline", args.html)):
            if path:
                print(f"{flag} written to {path}")
