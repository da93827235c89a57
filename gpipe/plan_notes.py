"""The lines under ``gpipe plan``'s tables: the fastest and the cheapest plan, and what each
hardware kind's figures rest on (its efficiency, its price), so no figure reads surer than it is.

Where an efficiency is assumed, a plan's days and dollars come with the same plan's at both ends of
:data:`sim.catalog.efficiency_note.ASSUMED_EFFICIENCY_RANGE` (:mod:`sim.planner.efficiency_range` prices them);
where some hardware has no price, the cheapest line says which it left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from gpipe.plan_rows import same_but_placement
from sim.catalog.efficiency_note import uncalibrated_note
from sim.planner.plan_search import layout_text
from sim.planner.search import PlanOption
from sim.planner.training_cost import dollars

if TYPE_CHECKING:
    from sim.planner.efficiency_range import Ends

COST_NOTE = ("tokens/s from the predicted step; MFU: PaLM's model FLOPs (6N + 12 L d s per token) over the devices' "
             "dense peak at the matmuls' precision; days, device-hours and cost at the on-demand list price, "
             "nothing for failures, restarts or evaluation")


def days_text(days: float) -> str:
    """``1551.0``, or three significant digits under a day (``0.0213``)."""
    return f"{days:.1f}" if days >= 1 else f"{days:.3g}"


def days_and_dollars(option: PlanOption) -> str:
    """``1551.0 days, $8,933,677``; without a price the days alone; empty without --train-tokens."""
    cost = option.cost
    if cost is None or cost.days is None:
        return ""
    return f"{days_text(cost.days)} days" + (f", {dollars(cost.cost)}" if cost.cost is not None else "")


def ends_text(ends: Ends | None) -> str:
    """`` (efficiency assumed, at 35%..75% of peak FLOP/s: 2068.1..1148.8 days, $11,912,095..$6,617,130)``
    to follow a point figure, or empty."""
    if ends is None:
        return ""
    (low, at_low), (high, at_high) = ends
    a, b = at_low.cost, at_high.cost
    money = f", {dollars(a.cost)}..{dollars(b.cost)}" if a.cost is not None and b.cost is not None else ""
    return (f" (efficiency assumed, at {low:.0%}..{high:.0%} of peak FLOP/s: {days_text(a.days)}..{days_text(b.days)} "
            f"days{money})")


def summary_line(label: str, option: PlanOption | None, ends: Ends | None = None) -> str | None:
    """``fastest: b200-nvlink, T=8 D=4 K=2 V=4 M=64 never interleaved, 64 devices, MFU 37.4%: 1551.0
    days, $8,933,677`` and, for an assumed efficiency, the same plan at both ends of its range."""
    if option is None or option.cost is None:
        return None
    figures = days_and_dollars(option)
    return (f"{label}: {option.hardware}, {layout_text(option)} {option.candidate.checkpoint} "
            f"{option.candidate.schedule}, {option.cost.devices} device{'s' * (option.cost.devices != 1)}, "
            f"MFU {option.cost.mfu:.1%}"
            + (f": {figures}" if figures else "") + ends_text(ends))


def cheapest_line(cheapest: PlanOption | None, unpriced: Sequence[str], ends: Ends | None = None) -> str | None:
    """The cheapest plan among the priced hardware, naming the kinds without a price; None where every
    kind is priced and there is no cheapest (no --train-tokens)."""
    if not unpriced:
        return summary_line("cheapest", cheapest, ends)
    missing = (f"no list price for {', '.join(unpriced)}; give --price-per-device-hour to price "
               + ("it" if len(unpriced) == 1 else "them"))
    if cheapest is None or cheapest.cost is None:
        return f"cheapest: unknown, {missing}"
    return summary_line(f"cheapest of the priced hardware ({missing})", cheapest, ends)


def hardware_line(name: str, nodes: int, efficiency: str, price: float | None, source: str,
                  best: PlanOption | None = None, ends: Ends | None = None) -> str:
    """What one hardware kind's figures rest on: its efficiency and price; given ``best`` and its
    ``ends`` (a best plan no fastest or cheapest line shows), its days and dollars across the range."""
    priced = f"${price:.2f} per device-hour ({source})" if price is not None else "no price"
    at_ends = f"; its best plan {days_and_dollars(best)}{ends_text(ends)}" if best is not None and ends else ""
    return f"{name} x{nodes} node(s): {efficiency}{at_ends}; {priced}"


def note_lines(planned: Sequence, fastest: PlanOption | None, cheapest: PlanOption | None, costed: bool,
               days: bool, ends: Callable[[PlanOption | None], "Ends | None"],
               efficiency: Callable[[object], tuple[str, str]], price: Callable[[object], tuple[float | None, str]],
               costs_path: str | None) -> list[str]:
    """The lines under the tables. ``planned``: each search (``system``, ``workload``, ``batch``,
    ``result``); ``efficiency(system)``: its kind and text (:mod:`sim.catalog.efficiency_note`);
    ``price(system)``: its price per device-hour and where it comes from; ``ends``: a plan's days
    and dollars across an assumed efficiency's range. With days and dollars (``costed``): the
    fastest and the cheapest plan, then a line per hardware kind; without, only the efficiencies
    given, calibrated or assumed. A CPU without costs is said to be uncalibrated either way."""
    lines: list[str | None] = []
    if costed:
        unpriced = [p.system.name for p in planned if price(p.system)[0] is None] if days else []
        lines += [summary_line("fastest", fastest, ends(fastest)), cheapest_line(cheapest, unpriced, ends(cheapest))]
    shown = [o for o in (fastest, cheapest) if o is not None]
    for p in planned:
        kind, text = efficiency(p.system)
        if costed:
            best = p.result.best
            unsaid = best if best and not any(same_but_placement(best, o) for o in shown) else None  # not said above
            lines.append(hardware_line(p.system.name, p.system.nodes, text, *price(p.system), unsaid, ends(unsaid)))
        elif kind in ("given", "calibrated", "assumed"):
            lines.append(f"{p.system.name}: {text}")
        if kind == "uncalibrated":
            lines.append(uncalibrated_note(p.system, p.workload, p.batch, costs_path))
    if costed:
        lines.append(COST_NOTE)
    return [line for line in lines if line]
