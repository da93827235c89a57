"""The demo's one-page HTML report: timelines, the loss curve, bubble and memory, the error table.

Built from plotly figures (:mod:`sim.views.figures` for the timelines, so they look as everywhere else)
and a plain HTML table; plotly.js is embedded once, so the file opens offline.
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.formats.timeline import Timeline


def one_step(report: dict[str, Any]) -> Timeline:
    """The measured step whose time is the median, shifted to start at 0 (as a simulated step)."""
    timeline = Timeline.from_dict(report["timeline"])
    times = report["step_times_s"]
    measured = report["measured_steps"] or list(range(len(times)))
    median = sorted(measured, key=lambda s: times[s])[len(measured) // 2]
    records = [r for r in timeline.records if r.step == median]
    start = min(r.start_s for r in records)
    end = max(r.end_s for r in records)
    shifted = [r._replace(start_s=r.start_s - start, end_s=r.end_s - start, step=0) for r in records]  # chunk kept
    memory = [type(s)(s.stage, s.time_s - start, s.bytes) for s in timeline.memory if start <= s.time_s <= end]
    return Timeline(records=shifted, memory=memory, source="measured", meta=dict(timeline.meta))


def summary_figure(predicted_busy_s: Sequence[float], predicted_step_s: float, measured_busy_s: Sequence[float],
                   measured_step_s: float, predicted_bytes: Sequence[int], measured_bytes: Sequence[int]) -> go.Figure:
    """Side by side, per stage: busy and idle (bubble) ms of one step, and peak activation MiB.

    One figure with two panels rather than two figures in an HTML row: plotly sizes a single figure
    to its container reliably, two figures side by side less so.
    """
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("Busy and bubble per stage (ms per step)",
                                        "Peak activation memory per stage (MiB)"))
    stages = [f"stage {k}" for k in range(len(predicted_busy_s))]
    for label, busy, step, nbytes, colour in (
            ("predicted", predicted_busy_s, predicted_step_s, predicted_bytes, "#4C78A8"),
            ("measured", measured_busy_s, measured_step_s, measured_bytes, "#F58518")):
        x = [f"{stage} {label}" for stage in stages]
        fig.add_trace(go.Bar(x=x, y=[b * 1e3 for b in busy], name=f"{label} busy", marker_color=colour,
                             legendgroup=label), row=1, col=1)
        fig.add_trace(go.Bar(x=x, y=[max(step - b, 0.0) * 1e3 for b in busy], name=f"{label} idle (bubble)",
                             marker_color=colour, opacity=0.35, legendgroup=label), row=1, col=1)
        fig.add_trace(go.Bar(x=stages, y=[b / 2**20 for b in nbytes], name=f"{label} peak activation",
                             marker_color=colour, legendgroup=label, offsetgroup=label), row=1, col=2)
    order = [f"{stage} {label}" for stage in stages for label in ("predicted", "measured")]
    fig.update_xaxes(categoryorder="array", categoryarray=order, row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=2)
    fig.update_layout(barmode="stack", height=420, legend={"orientation": "h", "y": -0.2})
    fig.update_traces(selector={"offsetgroup": "predicted"}, width=0.35)
    fig.update_traces(selector={"offsetgroup": "measured"}, width=0.35)
    return fig


def loss_figure(losses: Sequence[float], data_label: str, vocab: int | None = None) -> go.Figure:
    """The training loss at every step, with ln(vocab) dotted: where a model guessing uniformly sits,
    so a curve that falls below it shows the model learning (random tokens keep it there)."""
    fig = go.Figure(go.Scatter(x=list(range(len(losses))), y=list(losses), mode="lines+markers",
                               name="loss", line={"color": "#4C78A8"}))
    if vocab:
        fig.add_hline(y=math.log(vocab), line_dash="dot", line_color="#888",
                      annotation_text=f"ln {vocab}: a uniform guess", annotation_position="top right")
    fig.update_layout(title=f"Training loss per step ({data_label})", height=320,
                      xaxis_title="step", yaxis_title="cross entropy (nats)", margin={"t": 50, "b": 40})
    return fig


def error_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    """(quantity, predicted, measured, error) rows as an HTML table."""
    head = "<tr><th>quantity</th><th>predicted</th><th>measured</th><th>error</th></tr>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def write_report(path: str, title: str, intro: str, timelines: go.Figure, summary: go.Figure,
                 table_html: str, notes: Sequence[str], loss: go.Figure | None = None, verdict: str = "") -> None:
    """Assemble the page: heading, the verdict line, timelines, the loss curve, bubble beside memory,
    error table, notes."""
    config = {"responsive": True}
    parts = [timelines.to_html(full_html=False, include_plotlyjs=True, config=config),
             summary.to_html(full_html=False, include_plotlyjs=False, config=config),
             loss.to_html(full_html=False, include_plotlyjs=False, config=config) if loss is not None else ""]
    note_items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 0.3em 0.8em; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{f'<p class="verdict"><strong>{html.escape(verdict)}</strong></p>' if verdict else ""}
<p>{html.escape(intro)}</p>
<h2>Predicted and measured step, same time axis</h2>
{parts[0]}
{parts[2]}
{parts[1]}
<h2>Prediction error</h2>
{table_html}
<ul>{note_items}</ul>
</body></html>
"""
    with open(path, "w") as handle:
        handle.write(page)
