"""``gpipe plan --max-layers``: the deepest model that fits per K, as a table or JSON.

The command-line half of :mod:`sim.planner.max_layers`: it reads the flags, builds a workload of each depth
(torch models through the meta-device analysis, see :mod:`gpipe.workload_flags`) and prints.
"""

from __future__ import annotations

import json
import sys

from gpipe.options import parse_int_list
from gpipe.workload_flags import model_name, resolve_workload, with_precision
from sim.catalog.hardware import System
from sim.errors import GpipeInputError, require_positive
from sim.planner.max_layers import depth_limits, format_limits
from sim.workloads.model_defaults import DEFAULT_BATCH
from sim.workloads.workload import Workload


def run(args, system: System, options: dict, precision: str, attention_note: str | None = None) -> int:
    """``gpipe plan --max-layers``: the table (or JSON) for the model and system the flags name."""
    if args.costs:
        raise GpipeInputError("--max-layers varies the depth, which a measured costs file cannot; "
                              "drop --costs (use --efficiency-from COSTS for its fitted efficiency)")
    options.pop("layers", None)
    model = model_name(args)
    batch = args.batch if args.batch is not None else DEFAULT_BATCH.get(model, 32)
    require_positive("batch size", batch, "use --batch 1 or more")
    microbatches = parse_int_list(args.microbatch_options, "--microbatch-options")
    if args.stages_options:
        stage_options = parse_int_list(args.stages_options, "--stages-options")
        for k in stage_options:
            system.check_fits(k)
    else:
        stage_options = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= system.total_devices]

    def make(depth: int) -> Workload:
        return resolve_workload(model, with_precision(model, {**options, "layers": depth}, precision))

    limits = depth_limits(make, system, batch, stage_options, microbatches)
    if args.json:
        rows = [{"stages": a.stages, "with_rematerialization": a.to_dict(), "without": b.to_dict()}
                for a, b in limits]
        json.dump({"system": system.name, "batch_size": batch, "precision": precision, "limits": rows},
                  sys.stdout)
        print()
    else:
        print(format_limits(limits, system, batch, model, precision))
        if attention_note:
            print(attention_note)
    return 0
