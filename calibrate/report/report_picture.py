"""The demo report as one PNG (``gpipe demo --picture FILE``): the picture the README shows.

The predicted and measured step on one time axis (left) beside the loss curve (right), built from
the very traces the HTML report draws, so the picture is the report, not a drawing of it. Plotly
renders PNGs through Kaleido, an optional package: ``kaleido>=1`` drives a Chrome it finds or
downloads; ``kaleido==0.2.1`` ships its own Chromium and needs nothing else, which is how the
committed picture was made (offline). Without either, ``--picture`` is refused in one line.

Limits: the picture leaves out the memory rows, the bubble and memory bars and the error table
(the HTML page has them); hover text does not survive in a PNG.
"""

from __future__ import annotations

import json
import os
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.errors import GpipeInputError

PICTURE_SIZE_PX = (1400, 560)  # width, height: readable at GitHub's README width


def picture_figure(timelines: go.Figure, loss: go.Figure, title: str) -> go.Figure:
    """``timelines`` (two rows, predicted over measured, no memory rows) on the left and ``loss`` on
    the right of one figure."""
    fig = make_subplots(rows=2, cols=2, column_widths=[0.68, 0.32], shared_xaxes=False,
                        specs=[[{}, {"rowspan": 2}], [{}, None]], horizontal_spacing=0.08, vertical_spacing=0.14,
                        subplot_titles=("predicted step (simulator)", "training loss per step",
                                        "measured step (executor)"))
    for trace in timelines.data:
        row = 2 if trace.yaxis == "y2" else 1
        fig.add_trace(trace, row=row, col=1)
    for trace in loss.data:
        fig.add_trace(trace, row=1, col=2)
    for shape in loss.layout.shapes or ():  # the ln(vocab) line
        fig.add_hline(y=shape.y0, line_dash="dot", line_color="#888", row=1, col=2,
                      annotation_text="uniform guess", annotation_position="top right")
    top = max((bar.base[i] + bar.x[i] for bar in timelines.data if bar.base is not None
               for i in range(len(bar.x))), default=1.0)
    for row in (1, 2):
        fig.update_xaxes(range=[0, top * 1.01], row=row, col=1)
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    fig.update_xaxes(title_text="time (ms)", row=2, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="loss (nats)", row=1, col=2)
    fig.update_layout(title=title, barmode="overlay", width=PICTURE_SIZE_PX[0], height=PICTURE_SIZE_PX[1],
                      legend={"orientation": "h", "y": -0.12}, margin={"t": 80, "l": 70, "r": 30, "b": 60},
                      plot_bgcolor="white")
    return fig


def kaleido_major_version() -> int:
    """The installed Kaleido's major version; one line saying how to get it where there is none."""
    try:
        import kaleido
    except ImportError:
        raise GpipeInputError("--picture renders a PNG through Kaleido, which is not installed; pip install "
                              "kaleido==0.2.1 (it brings its own Chromium), or drop --picture") from None
    return int(str(getattr(kaleido, "__version__", "0")).split(".")[0])


def write_png(fig: go.Figure, path: str) -> None:
    """``fig`` as a PNG at ``path``, through whichever Kaleido is installed."""
    if kaleido_major_version() >= 1:
        fig.write_image(path, format="png")
        return
    with open(path, "wb") as handle:
        handle.write(_render_with_bundled_chromium(fig))


def _render_with_bundled_chromium(fig: go.Figure) -> bytes:
    """Kaleido 0.2's own renderer, given the plotly.js of the installed plotly: plotly 6 and later
    no longer drive Kaleido below 1.0, and its bundled plotly.js is older than their figures."""
    import plotly
    from kaleido.scopes.plotly import PlotlyScope

    plotly_js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    scope = PlotlyScope(plotlyjs=plotly_js, mathjax=False)
    spec: dict[str, Any] = json.loads(fig.to_json())
    return scope.transform(spec, format="png", width=PICTURE_SIZE_PX[0], height=PICTURE_SIZE_PX[1])
