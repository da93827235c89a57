"""Command-line flags shared by the ``gpipe`` commands: one definition each, one validation style.

A flag that more than one command takes is declared here and nowhere else
(tests/commands/test_flag_definitions.py checks it), and means the same on each: ``--stages`` is
one K, ``--replicas`` one D, ``--hardware`` one system (``gpipe plan`` also ranks several given with
commas); ``gpipe plan``'s lists of values to search have names of their own (``--stages-options``,
``--replicas-options``, ...), and the list form under a single value's name is refused in one line
naming the new flag (:data:`RENAMED_IN_PLAN`). A command passes its own default and, where the help
must say more, its own words; the name, type and check are these.

A value is checked in one line naming the value and the fix (GpipeInputError: ``gpipe: error:
...``, exit 2): names from a list by the actions here as they are parsed (:class:`Checked`), never
with argparse ``choices`` and its usage block; numbers by the command that reads them.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from sim.catalog.hardware import SYSTEMS
from sim.errors import GpipeInputError, did_you_mean, require_positive
from sim.schedules.schedule import (CHECKPOINT_POLICIES, SCHEDULES, check_checkpoint_policy,
                                    check_schedule_name, default_virtual_stages)
from sim.workloads.model_defaults import DEFAULT_OPTIONS, MODEL_FLAGS
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, optimizer_slots

# Options of the simulator's models that describe the training, not the torch model: optimizer
# state tensors per parameter (set from --optimizer, see sim.workloads.optimizers). The precision is a flag
# and a plan field of its own (sim.workloads.precision).
ANALYTIC_ONLY_OPTIONS = ("optimizer_slots",)

# --hardware not given, and no plan or costs file that records one: the machine gpipe runs on, the one
# gpipe train trains on and gpipe calibrate measures (nominal figures until a costs file is given)
DEFAULT_HARDWARE = "cpu"
DEVICES = ("cpu", "cuda")
PARTITIONERS = ("min_max", "variance")
# gpipe plan's lists of values to search, by the flag of one value they list (gpipe simulate's): numbers
# take the suffix -options, names the plural; the single value's flag is refused in plan in one line
RENAMED_IN_PLAN = {"--stages": ("--stages-options", "K"), "--microbatches": ("--microbatch-options", "M"),
                   "--replicas": ("--replicas-options", "D"), "--virtual-stages": ("--virtual-stages-options", "V"),
                   "--tensor-parallel": ("--tensor-parallel-options", "T"), "--zero": ("--zero-options", "ZeRO stages"),
                   "--shard-group": ("--shard-group-options", "shard groups"),
                   "--gradient-sync": ("--gradient-sync-options", "gradient syncs"),
                   "--expert-parallel": ("--expert-parallel-options", "E"),
                   "--expert-tensor-parallel": ("--expert-tensor-parallel-options", "ETP"),
                   "--checkpoint": ("--checkpoints", "policies"), "--schedule": ("--schedules", "schedules"),
                   "--placement": ("--placements", "placements")}


class Checked(argparse.Action):
    """Store a flag's value once ``check(value)`` accepts it; ``check`` raises the one-line error
    (GpipeInputError) that :mod:`gpipe.main` prints, where argparse ``choices`` would print usage."""

    def __init__(self, option_strings: Sequence[str], dest: str, check: Callable[[Any], Any], **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.check = check

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.check(values))


def one_of(flag: str, names: Sequence[str]) -> Callable[[str], str]:
    """A check for :class:`Checked`: ``value`` if it is one of ``names``, else one line naming them."""
    def check(value: str) -> str:
        if value not in names:
            raise GpipeInputError(f"unknown {flag} {value!r}{did_you_mean(value, names)}; choose one of "
                                  f"{', '.join(names)}")
        return value
    return check


class Renamed(argparse.Action):
    """A single value's flag that ``gpipe plan`` takes as a list under another name: refused in one line."""

    def __init__(self, option_strings: Sequence[str], dest: str, renamed: str, meaning: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.renamed, self.meaning = renamed, meaning

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise GpipeInputError(f"gpipe plan searches a list of {self.meaning}: write {self.renamed} {values} "
                              f"({option_string} is one value, in gpipe simulate and gpipe train)")


# ----------------------------------------------------------------------------- the model


def add_model_arguments(parser: argparse.ArgumentParser, costs: bool = True, default: str | None = None) -> None:
    """The model flags; ``--model`` is ``default`` when not given (None: each command picks its own)."""
    group = parser.add_argument_group("model")
    said = (f" (default {default})" if default else
            " (default uniform, or with --costs the costs file's model)" if costs else "")
    group.add_argument("--model", default=default,
                       help=f"built-in model ({', '.join(DEFAULT_OPTIONS)}), a named model (gpipe plan "
                            f"--list-models), hf:TYPE or package.module:factory{said}")
    for flag, (_, kind, help_text) in MODEL_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help=help_text)
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="another model option, e.g. --option d_model=128 or, for hf: models, any config "
                            "field --option num_hidden_layers=4 (repeatable)")
    if costs:
        add_costs_argument(group)


def add_costs_argument(parser: Any, several: bool = False) -> None:
    """``--costs``: what ``gpipe calibrate`` measured, in place of the analytic model; ``several``:
    one file or more, each predicting the same runs (``gpipe validate``)."""
    meaning = ("costs file from gpipe calibrate; more files (calibrations of the same model taken at other moments) "
               "each predict the same measured runs: how far the moment of calibration moves an error" if several else
               "measured costs from gpipe calibrate, in place of the analytic model")
    extra: dict[str, Any] = {"required": True, "nargs": "+"} if several else {"default": None}
    parser.add_argument("--costs", metavar="FILE", help=meaning, **extra)


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


def add_precision_argument(parser: Any, default_help: str) -> None:
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


def add_batch_argument(parser: Any, meaning: str = "rows per mini-batch (default per model)") -> None:
    parser.add_argument("--batch", type=int, default=None, help=meaning)


# ----------------------------------------------------------------------------- one layout


def _default(value: Any, recorded: str | None) -> tuple[Any, str]:
    """(argparse default, the help's words): the value, or with ``recorded`` None and 'the plan's, else VALUE'."""
    return (value, f"default {value}") if recorded is None else (None, f"default: {recorded}, else {value}")


def add_pipeline_arguments(parser: argparse.ArgumentParser, stages: str = "4", microbatches: int = 8,
                           recorded: str | None = None) -> None:
    """K, M, the batch, the partition, the policy and the schedule of one plan. ``recorded`` (e.g.
    "the plan's") makes every default None, the value a plan file gives, else the one named."""
    group = parser.add_argument_group("pipeline")
    group.add_argument("--stages", "-K", type=int, default=None, help=f"pipeline stages K (default: {stages})")
    value, said = _default(microbatches, recorded)
    group.add_argument("--microbatches", "-M", type=int, default=value, help=f"micro-batches per mini-batch M ({said})")
    add_batch_argument(group, "rows per mini-batch, the global batch with replicas (default per model)")
    group.add_argument("--partition", default=None,
                       help="layers per stage, e.g. 3,5 (V x K chunks in model order with V > 1; default: balanced "
                            "on the simulator's costs)")
    value, said = _default("except_last", recorded)
    group.add_argument("--checkpoint", default=value, action=Checked, check=check_checkpoint_policy,
                       help=f"re-materialization: {', '.join(CHECKPOINT_POLICIES)} ({said})")
    value, said = _default("gpipe", recorded)
    group.add_argument("--schedule", default=value, action=Checked, check=check_schedule_name,
                       help=f"{', '.join(SCHEDULES)} ({said})")


def add_scale_out_arguments(parser: argparse.ArgumentParser, recorded: str | None = None,
                            sequence_parallel: str = "on wherever T > 1", context: bool = True) -> None:
    """Data-parallel replicas, virtual stages, ZeRO, placement and tensor parallelism of one plan
    (``context``: also context parallelism and the overlapped all-reduce, which only the simulator has)."""
    from sim.engine.placement import DEFAULT_PLACEMENT, PLACEMENTS, check_placement

    group = parser.add_argument_group("replicas, interleaving and tensor parallelism")
    value, said = _default(1, recorded)
    group.add_argument("--replicas", "-D", type=int, default=value,
                       help=f"data-parallel copies of the pipeline D, each on its torch.chunk share of --batch ({said})")
    group.add_argument("--virtual-stages", "-V", type=int, default=None,
                       help="chunks of layers per device V: 2 or more with --schedule interleaved, 2 with zbv and "
                            "dualpipev (default 2 there, 1 elsewhere)")
    value, said = _default(0, recorded)
    group.add_argument("--zero", type=int, default=value,
                       help=f"shard over the replicas: 1 optimizer state (ZeRO-1), 2 and gradients (ZeRO-2), 3 and "
                            f"parameters, gathered per block as FSDP does (ZeRO-3) ({said})")
    group.add_argument("--shard-group", type=int, default=None, metavar="N",
                       help="with --zero 2 or 3: shard within groups of N replicas and replicate across them "
                            "(HSDP; default all replicas)")
    add_gradient_sync_argument(group, recorded)
    value, said = _default(DEFAULT_PLACEMENT, recorded)
    group.add_argument("--placement", default=value, action=Checked, check=check_placement,
                       help=f"which device runs which replica's stage: {', '.join(PLACEMENTS)} ({said})")
    add_tensor_parallel_argument(group, *_default(1, recorded))
    add_sequence_parallel_argument(group, sequence_parallel)
    add_expert_parallel_arguments(group, *_default(1, recorded))
    if context:
        add_context_parallel_arguments(group)


def add_gradient_sync_argument(group: Any, recorded: str | None = None) -> None:
    """``--gradient-sync step|microbatch``: when ZeRO-2/3 reduce-scatters the gradients
    (:data:`sim.formats.layout.GRADIENT_SYNCS`); None is the trainers' default."""
    from sim.formats.layout import GRADIENT_SYNCS

    default = f"{recorded}, else " if recorded else ""
    group.add_argument("--gradient-sync", default=None, metavar="step|microbatch", action=Checked,
                       check=one_of("--gradient-sync", GRADIENT_SYNCS),
                       help="with --zero 2 or 3: reduce-scatter the gradients once per step after the last "
                            "micro-batch, accumulating them unsharded (step), or after every micro-batch's backward, "
                            f"accumulating them sharded (microbatch) (default: {default}microbatch with one stage as "
                            "FSDP2 and DeepSpeed run it, step with a pipeline as torch's pipeline schedules do)")


def add_expert_parallel_arguments(group: Any, default: int | None = 1, said: str = "default 1") -> None:
    """--expert-parallel and --expert-tensor-parallel: a mixture of experts' routed experts split over E ranks
    of the T x C x D group of one stage, each expert over ETP of them (Megatron-Core's expert grid)."""
    group.add_argument("--expert-parallel", type=int, default=default, metavar="E",
                       help=f"split each MoE layer's routed experts over E ranks of a stage's T x C x D group, tokens "
                            f"sent to their experts' ranks and back by all-to-alls; E divides the experts ({said})")
    group.add_argument("--expert-tensor-parallel", type=int, default=None, metavar="ETP",
                       help="the experts' own tensor-parallel degree; E x ETP divides T x C x D (default T)")


def add_tensor_parallel_argument(group: Any, default: int | None, said: str,
                                 meaning: str = "T devices of one node per stage, each layer's heads and MLP split "
                                                "over them as Megatron-LM splits them") -> None:
    group.add_argument("--tensor-parallel", "-T", type=int, default=default, metavar="T", help=f"{meaning} ({said})")


def add_context_parallel_arguments(group: Any) -> None:
    """--context-parallel and --dp-overlap, which simulate and plan share."""
    group.add_argument("--context-parallel", "-C", type=int, default=1,
                       help="C more devices of the node per stage, each sequence split over them (ring attention "
                            "on flash kernels; the built-in transformer; default 1)")
    group.add_argument("--dp-overlap", action="store_true",
                       help="time the data-parallel gradient reduction bucket by bucket inside the last backward, "
                            "as Megatron-LM runs it (default: after it, as gpipe train runs it)")


def add_sequence_parallel_argument(group: Any, default: str = "on wherever T > 1") -> None:
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help=f"with tensor parallelism, split norms and dropout along the sequence (default: {default})")


def add_partitioner_argument(parser: Any) -> None:
    parser.add_argument("--partitioner", default="min_max", action=Checked, check=one_of("--partitioner", PARTITIONERS),
                        help=f"how to split layers when --partition is not given: {', '.join(PARTITIONERS)} "
                             "(default min_max)")


def virtual_stages_of(args: argparse.Namespace) -> int:
    """``--virtual-stages``, defaulting to 2 under the multi-chunk schedules and 1 elsewhere."""
    if args.virtual_stages is not None:
        return args.virtual_stages
    return default_virtual_stages(args.schedule)


def check_zero(zero: int, replicas: int | None = None, shard_group: int | None = None,
               gradient_sync: str | None = None) -> None:
    """``--zero`` 0-3, sharding only with two replicas or more (where ``replicas`` is known), and
    ``--shard-group`` and ``--gradient-sync`` only with ZeRO-2/3, the group dividing D
    (:func:`sim.formats.layout.check_sharding`, :func:`sim.formats.layout.check_gradient_sync`)."""
    from sim.formats.layout import check_gradient_sync, check_sharding

    check_sharding(zero, replicas, shard_group)
    check_gradient_sync(gradient_sync, zero)


# ----------------------------------------------------------------------------- the hardware


def add_hardware_argument(parser: Any, use: str = "the system to predict on", several: bool = False,
                          files: bool = True) -> None:
    """``--hardware``: one catalog system (``several``: or a comma-separated list); None when not
    given, resolved by :func:`hardware_of` (``files``: the command reads plan or costs files, whose
    system comes first)."""
    listed = " (several separated by commas are each searched and ranked together)" if several else ""
    recorded = "the --costs file's system, else " if files else ""
    one = {} if several else {"action": Checked, "check": one_system}
    parser.add_argument("--hardware", default=None, metavar="SYSTEM", **one,
                        help=f"{use}: one of {', '.join(SYSTEMS)}{listed}, or a system file FILE.json (docs/planning.md, "
                             f"'Your own cluster') (default: {recorded}{DEFAULT_HARDWARE}, "
                             f"this machine{'; a --plan file names its own' if files else ''})")


def one_system(value: str) -> str:
    """A check for :class:`Checked`: ``--hardware`` of a command that predicts on one system; a
    comma-separated list (which ``gpipe plan`` ranks) is one line, unless it is a file's path."""
    import os

    if "," in value and not os.path.isfile(value):
        first = next((name.strip() for name in value.split(",") if name.strip()), "h100-nvlink")
        raise GpipeInputError(f"--hardware {value!r} is a list, but only gpipe plan takes several systems (it ranks "
                              f"them together); give one, e.g. --hardware {first}")
    return value


def add_hardware_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    group = parser.add_argument_group("hardware")
    add_hardware_argument(group, several=several)
    group.add_argument("--nodes", type=int, default=1, help="nodes joined over InfiniBand (default 1)")


def hardware_of(args: argparse.Namespace) -> str:
    """``--hardware``; else the system a ``--costs`` file was measured on, where the catalog names it;
    else :data:`DEFAULT_HARDWARE`. (A plan file's system is read by the code that reads the plan.)"""
    if args.hardware is not None:
        return args.hardware
    costs = getattr(args, "costs", None)
    if costs:
        from sim.formats.costs import read_costs

        measured = read_costs(costs, warn=False).get("system", "cpu")
        if measured in SYSTEMS:
            return measured
    return DEFAULT_HARDWARE


def add_device_argument(parser: Any, meaning: str) -> None:
    parser.add_argument("--device", default="cpu", action=Checked, check=one_of("--device", DEVICES),
                        help=f"{meaning} (default cpu)")


# ----------------------------------------------------------------------------- runs and outputs


def add_steps_argument(parser: Any, default: int, meaning: str) -> None:
    parser.add_argument("--steps", type=int, default=default, help=f"{meaning} (default {default})")


def add_rounds_argument(parser: Any, default: int, meaning: str) -> None:
    parser.add_argument("--rounds", type=int, default=default, help=f"{meaning} (default {default})")


def add_force_argument(parser: Any, meaning: str) -> None:
    parser.add_argument("--force", action="store_true", help=meaning)


def add_data_argument(parser: Any, default: str | None = None, names: Sequence[str] | None = None,
                      meaning: str = "what to train on") -> None:
    """``--data``: what a run trains on; ``names`` limits it to those (checked in one line)."""
    extra: dict[str, Any] = {"action": Checked, "check": one_of("--data", names)} if names else {}
    parser.add_argument("--data", default=default, metavar="SOURCE", help=meaning, **extra)


def add_plan_argument(parser: Any, meaning: str) -> None:
    parser.add_argument("--plan", default=None, metavar="FILE", help=meaning)


def add_runs_file_argument(parser: Any) -> None:
    parser.add_argument("file", metavar="FILE", help="runs file, e.g. benchmarks/published_runs/dev.json")


def add_out_argument(parser: Any, meaning: str, default: str | None = None) -> None:
    parser.add_argument("--out", default=default, metavar="FILE", help=meaning)


def add_json_argument(parser: Any, meaning: str = "print one JSON object on stdout and nothing else") -> None:
    parser.add_argument("--json", action="store_true", help=meaning)


def add_html_argument(parser: Any, meaning: str) -> None:
    parser.add_argument("--html", default=None, metavar="FILE", help=meaning)


def add_trace_argument(parser: Any) -> None:
    parser.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (Perfetto) here")


def add_quiet_argument(parser: Any) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress bars or progress lines; only the result")


# ----------------------------------------------------------------------------- reading the flags


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
