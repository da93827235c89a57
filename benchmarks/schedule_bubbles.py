"""Every schedule's bubble against M on the textbook model: the table and the figure of docs/training.md.

K = 4 devices with free links, 2K identical layers (forward 1 ms, backward 2 ms of which the weight
gradients are half), M from 4 to 32 (:mod:`sim.schedules.schedule_bubbles`). Writes the points to
``benchmarks/results/schedule_bubbles.json`` and prints them; ``--png FILE`` also renders the plotly
figure (:func:`sim.views.figures.schedules_bubble_figure`) through Kaleido, as the demo's picture is
rendered (``calibrate/report/report_picture.py``: ``pip install kaleido==0.2.1``).

    .venv/bin/python benchmarks/schedule_bubbles.py [--png docs/schedule_bubbles.png]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sim.views.figures import schedules_bubble_figure  # noqa: E402
from sim.schedules.schedule_bubbles import DEFAULT_MICROBATCHES, schedule_bubbles  # noqa: E402
from sim.formats.timeline import write_json_atomic  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "schedule_bubbles.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--png", help="also render the figure to this PNG (needs Kaleido)")
    args = parser.parse_args(argv)
    points = schedule_bubbles(args.stages, DEFAULT_MICROBATCHES)
    for schedule in dict.fromkeys(p.schedule for p in points):
        print(f"{schedule:12s}" + "  ".join(f"M={p.microbatches}: {p.bubble_fraction:6.1%}"
                                           for p in points if p.schedule == schedule))
    write_json_atomic(args.out, {"stages": args.stages, "points": [asdict(p) for p in points],
                                 "command": "python benchmarks/schedule_bubbles.py " + " ".join(argv or sys.argv[1:])})
    if args.png:
        from calibrate.report.report_picture import write_png

        figure = schedules_bubble_figure(points, args.stages)
        figure.update_layout(width=1400, height=560)
        write_png(figure, args.png)
        print(f"figure written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
