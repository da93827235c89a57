"""What ``gpipe plan`` writes and prints: the plan file, the JSON object, the tables and their notes, the bar.

The search is :func:`sim.planner.plan_search.search_plans`'s; this module turns its
:class:`sim.planner.plan_search.PlanSearch` into the plan file (priced as planned, so ``gpipe
simulate --plan`` gives its step), ``--json``'s object, or the ranked table with the best plan per
hardware kind (:mod:`gpipe.plan_table`) and the lines under it (:mod:`gpipe.plan_notes`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpipe.plan_notes import note_lines
from gpipe.plan_rows import PlanRow, best_rows
from gpipe.plan_table import format_table
from gpipe.workload_flags import compiled_note, planned_from_note
from sim.catalog.efficiency_note import ASSUMED_EFFICIENCY_RANGE, efficiency_kind, efficiency_text
from sim.formats.plan import ModelRef, Plan
from sim.planner.efficiency_range import RangeEnds
from sim.planner.plan_search import PlanSearch, Planned
from sim.planner.search import PlanOption, SearchResult
from sim.planner.training_cost import Costing, plan_cost, price_of, price_source
from sim.views.progress import phase


def named_model_rows() -> list[dict[str, Any]]:
    """Each named model's shape, parameters and where the figures come from (``--list-models --json``)."""
    from sim.workloads.models import get_workload
    from sim.workloads.moe.workload import named_moe_workload
    from sim.workloads.named_models import named_models, named_options

    rows = []
    for name, model in named_models().items():
        workload = named_moe_workload(name, {}) if model.moe else get_workload("transformer", named_options(name, {}))
        o = workload.options
        rows.append({"name": name, "parameter_count": workload.parameter_count,
                     "layers": o["layers"], "d_model": o["d_model"], "heads": o["heads"],
                     "kv_heads": o["kv_heads"] or o["heads"], "ff": o["ff"], "seq": o["seq"], "source": model.source})
    return rows


def format_named_models() -> str:
    """One line per named model: its shape, parameters and where the figures come from."""
    lines = [f"{'model':16} {'params':>8} {'layers':>6} {'d_model':>7} {'heads':>9} {'ff':>6} {'seq':>6}  source"]
    for r in named_model_rows():
        heads = f"{r['heads']}/{r['kv_heads']}"
        lines.append(f"{r['name']:16} {r['parameter_count'] / 1e9:>7.1f}B {r['layers']:>6} {r['d_model']:>7} "
                     f"{heads:>9} {r['ff']:>6} {r['seq']:>6}  {r['source']}")
    lines.append("heads: query/key-value heads; params of the built-in transformer of that shape (learned positions "
                 "and biases included; a mixture of experts' every expert, its MTP modules too); --option seq=N or a "
                 "config field (num_hidden_layers=40) changes one")
    return "\n".join(lines)


def planned_optimizer(args: argparse.Namespace, workload: Any) -> str:
    """``--optimizer``, else the one a costs file measured with, else the default."""
    from sim.workloads.optimizers import DEFAULT_OPTIMIZER

    return args.optimizer or workload.optimizer or DEFAULT_OPTIMIZER


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
        partition=tuple(option.partition), batch_size=batch, layout=c, hardware={"system": system, "nodes": nodes},
        predicted={**option.result.to_dict(),
                   **({"training": option.cost.to_dict()} if getattr(option, "cost", None) is not None else {})},
        optimizer=optimizer, precision=precision, dp_overlap=dp_overlap,
    )


def priced_with(args: argparse.Namespace, hardware: dict) -> dict:
    """The plan's fields that say what it was priced with, so gpipe simulate --plan prices it alike:
    the costs file (path and hash) and the efficiencies given, applied as the search applied them."""
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


def option_dict(option: PlanOption) -> dict:
    c = option.candidate
    assert option.result is not None
    # "stages" is the per-device list of results and "pipeline_stages" is K, as in gpipe simulate --json
    return {"microbatches": c.microbatches, "checkpoint": c.checkpoint,
            "schedule": c.schedule, "replicas": c.replicas, "virtual_stages": c.virtual_stages, "zero": c.zero,
            "placement": c.placement, "tensor_parallel": c.tensor_parallel,
            "sequence_parallel": c.sequence_parallel, "context_parallel": c.context_parallel,
            "partition": option.partition, "hardware": getattr(option, "hardware", None),
            "training": option.cost.to_dict() if getattr(option, "cost", None) is not None else None,
            **({"expert_parallel": c.expert_parallel} if c.expert_parallel > 1 else {}),
            **({"expert_tensor_parallel": c.expert_tensor_parallel}
               if c.expert_tensor_parallel is not None else {}), **{
                k: v for k, v in option.result.to_dict().items()
                if k not in ("partition", "schedule", "checkpoint", "replicas", "virtual_stages", "zero", "placement")}}


def range_ends(args: argparse.Namespace, planned: list[Planned], costing: Costing) -> RangeEnds:
    """A plan's days and dollars at both ends of an assumed efficiency's range (:mod:`sim.planner.efficiency_range`)."""
    def assumed(system) -> bool:
        return efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs) == "assumed"

    return RangeEnds(planned, assumed,
                     lambda option, p: plan_cost(option, p.workload, p.system, p.batch, p.precision, costing),
                     args.dp_overlap)


def _hardware_dict(planned: Planned, args: argparse.Namespace, costing: Costing, ends: RangeEnds) -> dict:
    """``--json``'s entry for one hardware kind: what its efficiency and price rest on, its best plan
    and, for an assumed efficiency, that plan's days and dollars at both ends of the range."""
    system = planned.system
    kind = efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs)
    best = planned.result.best
    at_ends = ends(best)
    return {"nodes": system.nodes, "efficiency": kind, "efficiency_fraction": system.device.efficiency,
            "efficiency_range": list(ASSUMED_EFFICIENCY_RANGE) if kind == "assumed" else None,
            "price_per_device_hour": price_of(system, costing), "price_source": price_source(system, costing),
            "best": option_dict(best) if best is not None else None,
            "error_band": plan_band(planned, best),
            "best_at_efficiency_range": [o.cost.to_dict() for _, o in at_ends] if at_ends else None}


def plan_band(planned: Planned, option: PlanOption | None) -> dict | None:
    """The error band behind a hardware kind's best plan (:mod:`sim.evidence.error_bands`)."""
    from sim.evidence.error_bands import band_field

    if option is None:
        return None
    return band_field(planned.system.name, planned.system.device.name, planned.precision, option.candidate.stages,
                      experts=planned.workload.has_experts)


def print_json(args: argparse.Namespace, found: PlanSearch, ranked: list[PlanOption], searched: SearchResult,
               home: Planned, costing: Costing, fastest: PlanOption | None, cheapest: PlanOption | None) -> None:
    description = home.workload.describe()
    ends = range_ends(args, found.planned, costing)
    by_name = {p.system.name: p for p in found.planned}

    def banded(option: PlanOption) -> dict:
        return {**option_dict(option), "error_band": plan_band(by_name.get(option.hardware, home), option)}

    # one string, one write: json.dump writes piece by piece, which for thousands of devices' entries
    # costs more than the search
    model = {k: description[k] for k in ("name", "options", "num_layers", "parameter_count")}
    sys.stdout.write(json.dumps({"model": model,
               "parameter_count": description["parameter_count"], "precision": home.precision,
               "candidates": searched.candidates, "simulated": searched.simulated,
               "elapsed_s": searched.elapsed_s, "rank_by": costing.rank_by,
               "limits": {"max_devices": costing.max_devices, "max_cost": costing.max_cost,
                          "max_days": costing.max_days, "over_limit": searched.over_limit},
               "ranked": [banded(o) for o in ranked],
               "fastest": banded(fastest) if fastest else None,
               "cheapest": banded(cheapest) if cheapest else None,
               "hardware": {p.system.name: _hardware_dict(p, args, costing, ends) for p in found.planned},
               "planned_from": home.workload.planned_from}))
    print()


def print_plans(args: argparse.Namespace, found: PlanSearch, rows: list[PlanRow], searched: SearchResult,
                home: Planned, costing: Costing, fastest: PlanOption | None, cheapest: PlanOption | None,
                attention_note: str | None) -> None:
    """The ranked table, with several hardware kinds the best plan of each, then the notes
    (:mod:`gpipe.plan_notes`)."""
    planned = found.planned
    days = costing.train_tokens is not None
    systems = ",".join(p.system.name for p in planned)
    bests = best_rows(planned, rows) if len(planned) > 1 else []
    print(format_table(rows, searched, home.workload.describe(), systems, home.batch, home.precision,
                       costing.active, days, bests))

    def efficiency(system) -> tuple[str, str]:
        kind = efficiency_kind(system, args.efficiency, args.efficiency_from, args.costs)
        return kind, efficiency_text(system, kind, args.efficiency_from)

    bands = [f"error band   {p.system.name}: best {p.result.best.step_time_s:.4g} s, {band['text']}"
             for p in planned if p.result.best is not None for band in [plan_band(p, p.result.best)] if band]
    notes = [attention_note, *bands, planned_from_note(home.workload), compiled_note(home.workload),
             *note_lines(planned, fastest, cheapest, costing.active, days, range_ends(args, planned, costing),
                         efficiency, lambda system: (price_of(system, costing), price_source(system, costing)),
                         args.costs)]
    for note in notes:
        if note:
            print(note)


class SearchBar:
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
