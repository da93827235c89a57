"""Command-line flags shared by ``gpipe simulate``, ``plan``, ``train`` and ``calibrate``: one definition each."""

from __future__ import annotations

import argparse
from typing import Any

from sim.catalog.hardware import SYSTEMS
from sim.errors import GpipeInputError, require_positive
from sim.schedules.schedule import CHECKPOINT_POLICIES, SCHEDULES, default_virtual_stages
from sim.workloads.model_defaults import DEFAULT_OPTIONS, MODEL_FLAGS
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, optimizer_slots

# Options of the simulator's models that describe the training, not the torch model: optimizer
# state tensors per parameter (set from --optimizer, see sim.workloads.optimizers). The precision is a flag
# and a plan field of its own (sim.workloads.precision).
ANALYTIC_ONLY_OPTIONS = ("optimizer_slots",)


def add_model_arguments(parser: argparse.ArgumentParser, costs: bool = True) -> None:
    """The model flags; ``--model`` stays None when not given (each command picks its default)."""
    group = parser.add_argument_group("model")
    default = " (default uniform, or with --costs the costs file's model)" if costs else ""
    group.add_argument("--model", default=None,
                       help=f"built-in model ({', '.join(DEFAULT_OPTIONS)}) or package.module:factory{default}")
    for flag, (_, kind, help_text) in MODEL_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help=help_text)
    add_option_argument(group)
    if costs:
        group.add_argument("--costs", default=None, metavar="FILE",
                           help="measured costs from gpipe calibrate, in place of the analytic model")


def add_option_argument(group) -> None:
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="another model option, e.g. --option d_model=128 or, for hf: models, any config "
                            "field --option num_hidden_layers=4 (repeatable)")


def add_optimizer_argument(parser: Any, recorded: str | None = "the plan's or costs file's") -> None:
    """``--optimizer``: what gpipe train trains with, so the state the simulator holds per parameter.

    ``parser`` is a parser or an argument group. Not given, it is the one the plan or costs file
    records (``recorded`` says which, for the help), else the default; checked by
    :func:`sim.workloads.optimizers.check_optimizer` (one-line error) rather than by argparse.
    """
    default = f"{recorded}, else {DEFAULT_OPTIMIZER}" if recorded else DEFAULT_OPTIMIZER
    parser.add_argument("--optimizer", default=None, metavar="NAME",
                        help=f"{', '.join(OPTIMIZERS)} (torch.optim; adam and adamw keep 2 state tensors per "
                             f"parameter, sgd none); default: {default}")


def add_precision_argument(parser: argparse.ArgumentParser, default_help: str) -> None:
    """``--precision``: one flag, one meaning on every command (:mod:`sim.workloads.precision`); None when not
    given, so each command applies its own default. Checked by :func:`sim.workloads.precision.check_precision`
    (one line, exit 2) rather than argparse choices (a usage block)."""
    parser.add_argument("--precision", default=None, metavar="PRECISION",
                        help="fp32, or bf16: on the GPUs trainers train on, for the transformer and the named "
                             "models, their mixed precision (bf16 weights and activations, fp32 master weights and "
                             "gradients; also bf16-model), elsewhere and in train torch's autocast (also "
                             "bf16-autocast, on any device); for planning also fp8 (Transformer Engine's fp8 matmuls "
                             f"in the trainers' scheme) (default: {default_help})")


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile`` on ``simulate`` and ``plan``: the model as torch.compile runs it (the option ``compile``)."""
    parser.add_argument("--compile", action="store_true", default=None,
                        help="price torch.compile's fused elementwise regions, each region's memory traffic once "
                             "(the built-in transformer and models planned by its shape; the same as --option "
                             "compile=true)")


def add_pipeline_arguments(parser: argparse.ArgumentParser, stages_default: int | None = 4,
                           microbatches_default: int | None = 8) -> None:
    group = parser.add_argument_group("pipeline")
    group.add_argument("--stages", "-K", type=int, default=stages_default, help="pipeline stages K")
    group.add_argument("--microbatches", "-M", type=int, default=microbatches_default,
                       help="micro-batches per mini-batch M")
    group.add_argument("--batch", type=int, default=None, help="rows per mini-batch (default per model)")
    group.add_argument("--partition", default=None, help="layers per stage, e.g. 3,5 (default: balanced)")
    group.add_argument("--checkpoint", default="except_last", help=f"re-materialization: {', '.join(CHECKPOINT_POLICIES)}")
    group.add_argument("--schedule", default="gpipe", help=f"{', '.join(SCHEDULES)}")


def add_scale_out_arguments(parser: argparse.ArgumentParser) -> None:
    """``gpipe simulate``'s data-parallel replicas, virtual stages, ZeRO and placement of one plan."""
    from sim.engine.placement import DEFAULT_PLACEMENT, PLACEMENTS

    group = parser.add_argument_group("replicas and interleaving")
    group.add_argument("--replicas", "-D", type=int, default=1,
                       help="data-parallel copies of the pipeline D; --batch is the global batch (default 1)")
    group.add_argument("--virtual-stages", "-V", type=int, default=None,
                       help="chunks per device V with --schedule interleaved (default 2 there, 1 elsewhere)")
    group.add_argument("--zero", type=int, default=0, help="1: shard optimizer state over the replicas (ZeRO-1)")
    group.add_argument("--placement", default=DEFAULT_PLACEMENT,
                       help=f"which device runs which replica's stage: {', '.join(PLACEMENTS)} (default {DEFAULT_PLACEMENT})")
    group.add_argument("--tensor-parallel", "-T", type=int, default=1,
                       help="T devices of one node per stage, each layer split over them as Megatron-LM splits "
                            "it (the built-in transformer; default 1)")
    add_sequence_parallel_argument(group)
    add_context_parallel_arguments(group)


def add_context_parallel_arguments(group: Any) -> None:
    """--context-parallel and --dp-overlap, which simulate and plan share."""
    group.add_argument("--context-parallel", "-C", type=int, default=1,
                       help="C more devices of the node per stage, each sequence split over them (ring attention "
                            "on flash kernels; the built-in transformer; default 1)")
    group.add_argument("--dp-overlap", action="store_true",
                       help="time the data-parallel gradient reduction bucket by bucket inside the last backward, "
                            "as Megatron-LM runs it (default: after it, as gpipe train runs it)")


def add_sequence_parallel_argument(group: Any) -> None:
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="with tensor parallelism, split norms and dropout along the sequence (default: on "
                            "wherever T > 1)")


def virtual_stages_of(args: argparse.Namespace) -> int:
    """``--virtual-stages``, defaulting to 2 under the multi-chunk schedules and 1 elsewhere."""
    if args.virtual_stages is not None:
        return args.virtual_stages
    return default_virtual_stages(args.schedule)


def add_hardware_arguments(parser: argparse.ArgumentParser, default: str = "ideal") -> None:
    group = parser.add_argument_group("hardware")
    group.add_argument("--hardware", default=default,
                       help=f"one of {', '.join(SYSTEMS)}, or a system file FILE.json (docs/planning.md, "
                            f"'Your own cluster') (default {default})")
    group.add_argument("--nodes", type=int, default=1, help="nodes joined over InfiniBand (default 1)")


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options the user gave explicitly (flags, then ``--option KEY=VALUE``, values read as
    JSON where they parse); defaults are filled in by the model itself."""
    import json

    options = {}
    for flag, (name, _, _) in MODEL_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            options[name] = value
    for item in getattr(args, "option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GpipeInputError(f"bad --option {item!r}; expected KEY=VALUE, e.g. --option width=512")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"1,2,4"`` or ``"1-64"`` (inclusive) or a mix: ``"1-4,8,16"``; sorted, without repeats."""
    values: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                low, high = (int(v) for v in part.split("-", 1))
                values.extend(range(low, high + 1))
            else:
                values.append(int(part))
    except ValueError:
        raise GpipeInputError(f"{flag} {text!r} is not a list of integers; write e.g. 1,2,4 or 1-64") from None
    for value in values:
        require_positive(f"every value of {flag}", value, f"fix {text!r}")
    if not values:
        raise GpipeInputError(f"{flag} {text!r} is empty; write e.g. 1,2,4 or 1-64")
    return sorted(set(values))


def simulation_options(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`model_options` plus the optimizer's state per parameter when ``--optimizer`` is given
    (the simulator's models otherwise hold two state tensors, adamw's, or what the costs file measured)
    and ``compile`` with ``--compile``."""
    options = model_options(args)
    if getattr(args, "compile", None):
        options["compile"] = True
    if getattr(args, "optimizer", None) is not None:
        options["optimizer_slots"] = optimizer_slots(args.optimizer)
    return options


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work if an output file cannot be written."""
    if path is None:
        return
    import os

    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise GpipeInputError(f"{flag} {path!r}: directory {directory!r} does not exist; create it first")
