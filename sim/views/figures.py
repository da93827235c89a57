"""Plotly figures of timelines: one bar per action, one colour per kind, micro-batch numbers on bars.

Used by the CLI (``--html``), the demo report and the notebooks, so a timeline looks the same
everywhere. Plotly is imported here and nowhere in the simulator's core.
"""

from __future__ import annotations

import os
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.formats.timeline import KIND_NAMES, Timeline, row_name

KIND_COLOURS = {
    "F": "#4C78A8",  # forward: blue
    "R": "#F58518",  # recompute: orange
    "B": "#54A24B",  # backward: green
    "I": "#88D27A",  # input gradient: light green
    "W": "#2E7D32",  # weight gradients: dark green
    "send_act": "#B279A2",
    "send_grad": "#9D755D",
    "recv_wait": "#D3D3D3",
    "optimizer": "#E45756",
    "overhead": "#BAB0AC",
    "allreduce_shared": "#72B7B2",
    "allreduce_dp": "#EECA3B",
    "tp_all_reduce": "#FF9DA6",
    "tp_reduce_scatter": "#D67195",
    "tp_all_gather": "#F2B8C6",
}
COMM_KINDS = ("send_act", "send_grad", "recv_wait", "allreduce_shared", "allreduce_dp", "tp_all_reduce",
              "tp_reduce_scatter", "tp_all_gather")
KIND_ORDER = ["F", "R", "B", "I", "W", "allreduce_shared", "allreduce_dp", "optimizer", "overhead", "send_act", "send_grad",
              "recv_wait", "tp_all_reduce", "tp_reduce_scatter", "tp_all_gather"]


def _add_timeline_traces(fig: go.Figure, timeline: Timeline, row: int, label: str,
                         show_legend: bool) -> None:
    replicas, parts = timeline.replicas, timeline.tensor_parallel
    for kind in KIND_ORDER:
        records = [r for r in timeline.records if r.kind == kind]
        if not records:
            continue
        comm = kind in COMM_KINDS  # a thin bar, drawn over the compute bar a tensor-parallel collective is in
        fig.add_trace(go.Bar(
            orientation="h",
            base=[r.start_s * 1e3 for r in records],
            x=[max(r.duration_s, 0.0) * 1e3 for r in records],
            y=[f"{label}{row_name(r.replica, r.stage, replicas, r.tp, parts)}" for r in records],
            width=0.35 if comm else 0.8,
            offset=0.05 if comm else -0.4,
            marker_color=KIND_COLOURS[kind],
            opacity=0.6 if comm else 1.0,
            name=KIND_NAMES[kind],
            legendgroup=kind,
            showlegend=show_legend,
            text=[_bar_text(r) if r.microbatch >= 0 and not comm else "" for r in records],
            textposition="inside",
            insidetextanchor="middle",
            customdata=[[r.microbatch, r.start_s * 1e3, r.end_s * 1e3, r.duration_s * 1e3] for r in records],
            hovertemplate=(f"{KIND_NAMES[kind]}<br>micro-batch %{{customdata[0]}}<br>"
                           "start %{customdata[1]:.4f} ms<br>end %{customdata[2]:.4f} ms<br>"
                           "duration %{customdata[3]:.4f} ms<extra>%{y}</extra>"),
        ), row=row, col=1)


def _bar_text(record) -> str:
    """The micro-batch, and under the interleaved schedule the virtual stage it ran (``3@v2``)."""
    if record.virtual_stage is None:
        return str(record.microbatch)
    return f"{record.microbatch}@v{record.virtual_stage}"


def _add_memory_traces(fig: go.Figure, timeline: Timeline, row: int, label: str) -> None:
    for stage in range(timeline.stages):
        samples = sorted((s for s in timeline.memory if s.stage == stage), key=lambda s: s.time_s)
        if not samples:
            continue
        fig.add_trace(go.Scatter(
            x=[s.time_s * 1e3 for s in samples], y=[s.bytes / 2**20 for s in samples],
            mode="lines", line_shape="hv", name=f"{label}stage {stage} memory",
            hovertemplate="%{y:.2f} MiB at %{x:.4f} ms<extra>" + f"{label}stage {stage}</extra>",
        ), row=row, col=1)


def timeline_figure(timeline: Timeline, title: str = "Pipeline timeline", memory: bool = True) -> go.Figure:
    """Bars per stage over time (ms) and, below, the activation memory each stage holds."""
    return compare_figure([timeline], [""], title=title, memory=memory)


def compare_figure(timelines: Sequence[Timeline], labels: Sequence[str], title: str = "Timelines",
                   memory: bool = True) -> go.Figure:
    """Several timelines one above the other on one shared time axis (e.g. predicted and measured)."""
    rows = len(timelines) * (2 if memory else 1)
    heights = []
    titles = []
    for label, timeline in zip(labels, timelines):
        heights.append(max(timeline.stages, 1) * 0.6)
        titles.append(f"{label} timeline".strip())
        if memory:
            heights.append(1.0)
            titles.append(f"{label} activation memory (MiB)".strip())
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, row_heights=heights,
                        vertical_spacing=0.06, subplot_titles=titles)
    row = 1
    for index, (label, timeline) in enumerate(zip(labels, timelines)):
        prefix = f"{label} " if label else ""
        _add_timeline_traces(fig, timeline, row, prefix, show_legend=index == 0)
        fig.update_yaxes(autorange="reversed", row=row, col=1)
        row += 1
        if memory:
            _add_memory_traces(fig, timeline, row, prefix)
            fig.update_yaxes(title_text="MiB", row=row, col=1)
            row += 1
    fig.update_xaxes(title_text="time (ms)", row=rows, col=1)
    fig.update_layout(title=title, barmode="overlay", height=max(400, int(160 * sum(heights))),
                      hovermode="closest", legend_title_text="action")
    return fig


def write_html(fig: go.Figure, path: str | os.PathLike[str]) -> None:
    """Write a self-contained HTML file (plotly.js embedded, so it opens offline)."""
    fig.write_html(os.fspath(path), include_plotlyjs=True, full_html=True)


# --- Curves: what-if sweeps and the bubble against M ---------------------------------------------
K_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def _k_colour(stages: int) -> str:
    return K_COLOURS[max(stages.bit_length() - 1, 0) % len(K_COLOURS)]


def whatif_figure(points: Sequence, title: str = "What-if: step time, bubble and memory") -> go.Figure:
    """One column per system, rows step time (ms), bubble (%) and peak memory (GiB) against M.

    ``points`` are :class:`sim.planner.whatif.SweepPoint`; one line per K. Crosses mark plans that do not
    fit memory; the dashed line is the device's capacity.
    """
    systems = list(dict.fromkeys(p.system for p in points))
    fig = make_subplots(rows=3, cols=len(systems), shared_xaxes=True, column_titles=systems,
                        vertical_spacing=0.07, horizontal_spacing=0.05)
    shown: set[int] = set()
    for col, system in enumerate(systems, 1):
        mine = [p for p in points if p.system == system]
        for k in sorted({p.stages for p in mine}):
            line = sorted((p for p in mine if p.stages == k), key=lambda p: p.microbatches)
            for row, (values, fmt) in enumerate((
                    ([p.step_time_s * 1e3 for p in line], "step %{y:.3f} ms"),
                    ([p.bubble_fraction * 100 for p in line], "bubble %{y:.2f} %"),
                    ([p.peak_memory_bytes / 2**30 for p in line], "peak %{y:.3f} GiB")), 1):
                fig.add_trace(go.Scatter(
                    x=[p.microbatches for p in line], y=values, mode="lines+markers",
                    line_color=_k_colour(k), name=f"K={k}", legendgroup=f"K={k}",
                    showlegend=k not in shown and row == 1,
                    marker_symbol=["circle" if p.fits else "x" for p in line], marker_size=8,
                    hovertemplate=f"{system}<br>K={k}, M=%{{x}}<br>{fmt}<extra></extra>"),
                    row=row, col=col)
            shown.add(k)
        capacity = mine[0].capacity_bytes / 2**30 if mine else float("inf")
        if capacity != float("inf"):
            fig.add_hline(y=capacity, line_dash="dash", line_color="grey", row=3, col=col,
                          annotation_text=f"{capacity:.0f} GiB", annotation_position="top left")
        fig.update_xaxes(type="log", dtick=0.30103, title_text="micro-batches M", row=3, col=col)
    fig.update_yaxes(title_text="step time (ms)", row=1, col=1)
    fig.update_yaxes(title_text="bubble (%)", row=2, col=1)
    fig.update_yaxes(title_text="peak memory (GiB)", row=3, col=1)
    fig.update_layout(title=title, height=800, legend_title_text="stages", hovermode="closest")
    return fig


def bubble_figure(points: Sequence[tuple[int, int, float]], title: str = "Bubble against M") -> go.Figure:
    """Simulated bubble fractions ``(K, M, bubble)`` as markers, (K-1)/(M+K-1) as lines over them.

    The curve is the GPipe paper's bubble for balanced stages and free links (Huang et al. 2019,
    section 2.3).
    """
    fig = go.Figure()
    for k in sorted({p[0] for p in points}):
        mine = sorted((p for p in points if p[0] == k), key=lambda p: p[1])
        ms = list(range(1, max(p[1] for p in mine) + 1))
        fig.add_trace(go.Scatter(x=ms, y=[100 * (k - 1) / (m + k - 1) for m in ms], mode="lines",
                                 line_color=_k_colour(k), line_dash="dot", name=f"K={k} (K-1)/(M+K-1)",
                                 hovertemplate=f"K={k}, M=%{{x}}<br>formula %{{y:.2f}} %<extra></extra>"))
        fig.add_trace(go.Scatter(x=[p[1] for p in mine], y=[100 * p[2] for p in mine], mode="markers",
                                 marker_color=_k_colour(k), marker_size=9, name=f"K={k} simulated",
                                 hovertemplate=f"K={k}, M=%{{x}}<br>simulated %{{y:.2f}} %<extra></extra>"))
    fig.update_xaxes(type="log", dtick=0.30103, title_text="micro-batches M")
    fig.update_yaxes(title_text="bubble (% of the step each device idles)", rangemode="tozero")
    fig.update_layout(title=title, height=500, hovermode="closest")
    return fig


def paper_figure(cells: Sequence, title: str = "GPipe Table 2, Transformer-48: paper and simulation") -> go.Figure:
    """Normalised throughput per (K, M) cell, paper beside simulation; ``cells`` are PaperCell."""
    labels = [f"K={c.stages}, M={c.microbatches}" for c in cells]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[c.paper for c in cells], name="paper", marker_color="#9D755D",
                         text=[f"{c.paper:.2f}" for c in cells], textposition="outside",
                         hovertemplate="%{x}<br>paper %{y:.2f}x<extra></extra>"))
    fig.add_trace(go.Bar(
        x=labels, y=[c.simulated for c in cells], name="simulated", marker_color="#4C78A8",
        text=[f"{c.simulated:.2f}" for c in cells], textposition="outside",
        customdata=[[c.gap * 100, c.step_time_s * 1e3, c.bubble_fraction * 100] for c in cells],
        hovertemplate=("%{x}<br>simulated %{y:.3f}x<br>gap %{customdata[0]:+.1f} %<br>"
                       "step %{customdata[1]:.1f} ms<br>bubble %{customdata[2]:.1f} %<extra></extra>")))
    fig.update_yaxes(title_text="throughput, normalised to K=2, M=1")
    fig.update_layout(title=title, barmode="group", height=500)
    return fig


def write_html_many(figs: Sequence[go.Figure], path: str | os.PathLike[str], title: str = "gpipe") -> None:
    """Several figures in one self-contained HTML page (plotly.js embedded once)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
    with open(os.fspath(path), "w") as handle:
        handle.write(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head>"
                     f"<body>{''.join(parts)}</body></html>")


def replay_figure(results: Sequence, title: str = "Published runs: predicted against measured step time") -> go.Figure:
    """Predicted against measured step time per modelled run (``sim.evidence.replay.Replayed``), the diagonal
    being a perfect prediction; runs not modelled are listed in the title."""
    modelled = [r for r in results if r.modelled]
    skipped = [r.id for r in results if not r.modelled]
    top = max([r.measured_step_s for r in modelled] + [r.predicted_step_s for r in modelled] + [1e-3]) * 1.1
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="exact", line={"dash": "dot", "color": "#999"}))
    fig.add_trace(go.Scatter(
        x=[r.measured_step_s for r in modelled], y=[r.predicted_step_s for r in modelled], mode="markers+text",
        text=[r.id for r in modelled], textposition="top center", name="runs", marker={"size": 10, "color": "#4C78A8"},
        customdata=[[r.error * 100] for r in modelled],
        hovertemplate="%{text}<br>measured %{x:.3f} s<br>predicted %{y:.3f} s<br>error %{customdata[0]:+.1f} %<extra></extra>"))
    fig.update_xaxes(title_text="measured step (s)", range=[0, top])
    fig.update_yaxes(title_text="predicted step (s)", range=[0, top])
    note = f" (not modelled: {', '.join(skipped)})" if skipped else ""
    fig.update_layout(title=title + note, height=550, width=650)
    return fig


def schedules_bubble_figure(points: Sequence, stages: int,
                            title: str = "Bubble against micro-batches, every schedule") -> go.Figure:
    """One line per schedule through its ``(microbatches, bubble_fraction)`` points
    (:func:`sim.schedules.schedule_bubbles.schedule_bubbles`)."""
    fig = go.Figure()
    symbols = ("circle", "diamond", "square", "triangle-up", "x", "star")
    for index, schedule in enumerate(dict.fromkeys(p.schedule for p in points)):
        mine = [p for p in points if p.schedule == schedule]
        # every other line dashed, each its own marker: schedules with equal bubbles (gpipe and 1f1b,
        # zbv and dualpipev in eager PyTorch) stay visible on top of each other
        fig.add_trace(go.Scatter(x=[p.microbatches for p in mine], y=[p.bubble_fraction for p in mine],
                                 mode="lines+markers", name=schedule, line_dash="dash" if index % 2 else "solid",
                                 marker_symbol=symbols[index % len(symbols)], marker_size=9,
                                 hovertemplate=f"{schedule}, M=%{{x}}<br>bubble %{{y:.1%}}<extra></extra>"))
    fig.update_layout(title=f"{title} (K={stages}, simulated: identical layers, free links)", height=450,
                      xaxis_title="micro-batches M", yaxis_title="bubble (share of the step a device idles)",
                      yaxis_tickformat=".0%", hovermode="closest")
    return fig
