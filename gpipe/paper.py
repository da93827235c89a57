"""``gpipe paper``: the GPipe paper's Table 2 replayed in simulation, with the gap in every cell."""

from __future__ import annotations

import argparse
import json
import sys

from gpipe.options import add_html_argument, add_json_argument, check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, "print the cells as one JSON object")
    add_html_argument(parser, "write the paper-vs-simulation bars and the bubble against M as HTML")


def run(args: argparse.Namespace) -> int:
    from sim.evidence.paper import NOT_CAPTURED, TRANSFORMER_48, bubble_points, cells_to_dicts, format_table, replay

    check_output_path(args.html, "--html")
    cells = replay()
    if args.json:
        json.dump({"precision": TRANSFORMER_48["precision"], "cells": cells_to_dicts(cells),
                   "not_captured": NOT_CAPTURED}, sys.stdout)
        print()
    else:
        print(format_table(cells))
    if args.html:
        from sim.views.figures import bubble_figure, paper_figure, write_html_many

        figures = [paper_figure(cells),
                   bubble_figure(bubble_points(), title="Transformer-48 on TPUv3: simulated bubble "
                                 "against M, (K-1)/(M+K-1) dotted")]
        write_html_many(figures, args.html, title="GPipe Table 2 replay")
        if not args.json:
            print(f"figures written to {args.html}")
    return 0
