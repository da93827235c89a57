"""``gpipe plan``'s tables: the ranked plans, and the best plan of each hardware kind.

One row per :class:`gpipe.plan_rows.PlanRow` (plans equal but for placement share one); each column
is as wide as its widest cell, so a table stays narrow. With days and dollars the throughput shown
is tokens/s (samples/s without), and where ``--train-tokens`` prices the plans their days and cost
replace it (the days are the tokens over it).
"""

from __future__ import annotations

from typing import Any, Sequence

from gpipe.plan_notes import days_text
from gpipe.plan_rows import PlanRow, compact_partition
from sim.planner.search import SearchResult
from sim.views.report import describe_precision, gib

# (header, alignment, narrowest width): the layout's numbers keep their widths, so the columns line up
_LAYOUT = [("rank", ">", 4), ("T", ">", 3), ("D", ">", 3), ("K", ">", 3), ("V", ">", 2), ("M", ">", 3),
           ("checkpoint", "<", 0), ("schedule", "<", 0)]

KEY = ("placement: stages = stages_adjacent, replicas = replicas_adjacent, any = every placement predicts this "
       "step (one row for them all); partition: layers per stage, 3x9,7 = three stages of nine then one of seven")
TENSOR_KEY = ("T: devices of one node per stage, each layer split over them (s: sequence parallel; xC: times C "
              "context-parallel devices sharing each sequence); D x K x T x C devices in all; memory is one device's")


def format_table(rows: Sequence[PlanRow], searched: SearchResult, description: dict, systems: str, batch: int,
                 precision: str, costed: bool = False, days: bool = False,
                 bests: Sequence[tuple[str, PlanRow]] = ()) -> str:
    """The header line, the ranked rows (``costed``: with hardware, devices and MFU; ``days``: with
    days and dollars), the key to the columns, and given ``bests`` the best plan of each hardware
    kind, fastest first, with its rank text (``>N``: below the table's N rows) in the same columns."""
    head = (f"model {description['name']} ({description['num_layers']} layers, "
            f"{description['parameter_count'] / 1e6:.1f}M parameters), batch {batch}, on {systems}, "
            f"precision {describe_precision(precision)}: "
            f"{searched.candidates} candidates, {searched.simulated} simulated, {searched.not_fitting} do not fit, "
            + (f"{searched.over_limit} over the days or cost limit, " if searched.over_limit else "")
            + f"{searched.elapsed_s:.2f} s")
    ranked = [(str(rank), row) for rank, row in enumerate(rows, 1)]
    lines = table_lines([ranked, list(bests)], costed, days)
    table, best = lines[:len(ranked) + 1], lines[len(ranked) + 1:]
    shown = [row for _, row in ranked + list(bests)]
    keys = [KEY] + [TENSOR_KEY] * any(r.option.candidate.tensor_parallel > 1 or r.option.candidate.context_parallel > 1
                                      for r in shown)
    below = ["best per hardware (rank: its row in the table above):", *best] if bests else []
    return "\n".join([head, *table, *below, *keys])


def table_lines(tables: Sequence[Sequence[tuple[str, PlanRow]]], costed: bool, days: bool) -> list[str]:
    """Each table's header and one line per (rank text, row), all in the same columns."""
    ranked = [item for table in tables for item in table]
    zero = any(row.option.candidate.zero for _, row in ranked)
    experts = any(row.option.candidate.expert_parallel > 1 or row.option.candidate.expert_tensor_parallel is not None
                  for _, row in ranked)
    columns = list(_LAYOUT)
    if experts:  # E (xETP where it is not T), beside D: plans without expert parallelism print as before
        columns.insert(3, ("E", ">", 0))
    if costed:
        columns.insert(1, ("hardware", "<", 0))
    columns += [("zero", ">", 0)] * zero + [("placement", "<", 0), ("step ms", ">", 0), ("bubble", ">", 0)]
    if not costed:
        columns.append(("samples/s", ">", 0))
    columns.append(("peak mem", ">", 0))
    if costed:
        columns += [("devices", ">", 0), ("MFU", ">", 0)]
        columns += [("days", ">", 0), ("cost $", ">", 0)] if days else [("tokens/s", ">", 0)]
    columns.append(("partition", "<", 0))
    cells = [[_cells(rank, row, costed, days, zero, experts) for rank, row in table] for table in tables]
    widths = [max(minimum, len(header), *(len(line[i]) for table in cells for line in table))
              for i, (header, _, minimum) in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [f"{v:{align}{w}}" for v, (_, align, _), w in zip(values, columns, widths)]
        return (" ".join(parts[:-1]) + "  " + parts[-1]).rstrip()

    header = line([name for name, _, _ in columns])
    return [text for table in cells if table for text in (header, *(line(c) for c in table))]


def _zero_cell(c: Any) -> str:
    """The ZeRO stage, ``g`` and its HSDP shard group, ``/step`` or ``/mb`` where a gradient sync was
    searched (``--gradient-sync-options``; the trainers' default shows nothing)."""
    cell = f"{c.zero}g{c.shard_group}" if c.shard_group else str(c.zero)
    if c.gradient_sync is not None:
        cell += "/mb" if c.gradient_sync == "microbatch" else "/step"
    return cell


def _cells(rank: str, row: PlanRow, costed: bool, days: bool, zero: bool, experts: bool = False) -> list[str]:
    option = row.option
    c, r = option.candidate, option.result
    assert r is not None
    tensor = f"{c.tensor_parallel}{'s' if c.sequence_parallel else ''}"
    if c.context_parallel > 1:
        tensor += f"x{c.context_parallel}"
    cells = [rank, *([option.hardware] if costed else []), tensor, str(c.replicas), str(c.stages),
             str(c.virtual_stages), str(c.microbatches), c.checkpoint, c.schedule]
    if experts:
        etp = f"x{c.expert_tensor_parallel}" if c.expert_tensor_parallel is not None else ""
        cells.insert(4 if costed else 3, f"{c.expert_parallel}{etp}")
    cells += [_zero_cell(c)] * zero + [row.placement, f"{r.step_time_s * 1e3:.3f}", f"{r.bubble_fraction:.1%}"]
    if not costed:
        cells.append(f"{r.throughput_samples_per_s:.1f}")
    cells.append(gib(option.max_peak_memory_bytes))
    if costed:
        cost = option.cost
        cells += [str(cost.devices), f"{cost.mfu:.1%}"]
        if days:
            cells += [days_text(cost.days) if cost.days is not None else "-",
                      f"{cost.cost:,.0f}" if cost.cost is not None else "-"]
        else:
            cells.append(f"{cost.tokens_per_s:,.0f}")
    return cells + [compact_partition(option.partition)]
