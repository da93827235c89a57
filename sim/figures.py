"""Plotly figures of timelines: one bar per action, one colour per kind, micro-batch numbers on bars.

Used by the CLI (``--html``), the demo report and the notebooks, so a timeline looks the same
everywhere. Plotly is imported here and nowhere in the simulator's core.
"""

from __future__ import annotations

import os
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.timeline import KIND_NAMES, Timeline

KIND_COLOURS = {
    "F": "#4C78A8",  # forward: blue
    "R": "#F58518",  # recompute: orange
    "B": "#54A24B",  # backward: green
    "send_act": "#B279A2",
    "send_grad": "#9D755D",
    "recv_wait": "#D3D3D3",
    "optimizer": "#E45756",
}
KIND_ORDER = ["F", "R", "B", "optimizer", "send_act", "send_grad", "recv_wait"]


def _add_timeline_traces(fig: go.Figure, timeline: Timeline, row: int, label: str,
                         show_legend: bool) -> None:
    for kind in KIND_ORDER:
        records = [r for r in timeline.records if r.kind == kind]
        if not records:
            continue
        comm = kind in ("send_act", "send_grad", "recv_wait")
        fig.add_trace(go.Bar(
            orientation="h",
            base=[r.start_s * 1e3 for r in records],
            x=[max(r.duration_s, 0.0) * 1e3 for r in records],
            y=[f"{label}stage {r.stage}" for r in records],
            width=0.35 if comm else 0.8,
            offset=0.05 if comm else -0.4,
            marker_color=KIND_COLOURS[kind],
            opacity=0.6 if comm else 1.0,
            name=KIND_NAMES[kind],
            legendgroup=kind,
            showlegend=show_legend,
            text=[str(r.microbatch) if r.microbatch >= 0 and not comm else "" for r in records],
            textposition="inside",
            insidetextanchor="middle",
            customdata=[[r.microbatch, r.start_s * 1e3, r.end_s * 1e3, r.duration_s * 1e3] for r in records],
            hovertemplate=(f"{KIND_NAMES[kind]}<br>micro-batch %{{customdata[0]}}<br>"
                           "start %{customdata[1]:.4f} ms<br>end %{customdata[2]:.4f} ms<br>"
                           "duration %{customdata[3]:.4f} ms<extra>%{y}</extra>"),
        ), row=row, col=1)


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
