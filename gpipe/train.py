"""``gpipe train``: validate a plan, then start one worker process per stage under torchrun's agent.

Takes a plan file (``--plan``) or the flags ``gpipe simulate`` takes (model, stages or partition,
batch, micro-batches, schedule, checkpoint policy). The model is built and dry-run here first, so a
bad plan fails with one line before any process starts. On one machine its ranks are what
``python -m torch.distributed.run --standalone --nproc-per-node K -m executor.launch.worker CONFIG`` would
start, from torchrun's agent run in this process; with ``--nnodes N`` every node runs ``gpipe
train`` with the same flags, its ``--node-rank`` and node 0's address as ``--rdzv-endpoint
HOST:PORT``, each starting K/N workers (:mod:`executor.launch.agent` says how, and why the static
rendezvous).

torch is imported inside :func:`run` only, so ``gpipe --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any

from executor.launch.agent import check_capacity, check_nodes, run_ranks, start_fork_server
from gpipe.options import (ANALYTIC_ONLY_OPTIONS, Checked, add_data_argument, add_device_argument,
                           add_hardware_argument, add_html_argument, add_json_argument,
                           add_model_arguments, add_optimizer_argument, add_pipeline_arguments, add_plan_argument,
                           add_precision_argument, add_scale_out_arguments, add_steps_argument, add_trace_argument,
                           check_zero, hardware_of, model_options, one_of)
from sim.errors import GpipeInputError, require_positive
from sim.formats.layout import LAYOUT_KEYS, ParallelLayout, flat_layout
from sim.formats.plan import load_plan, parse_partition
from sim.planner.partition import even_partition
from sim.views.progress import bars_shown
from sim.workloads.named_models import is_named, named_models
from sim.workloads.precision import check_precision
from sim.schedules.schedule import MULTI_CHUNK_SCHEDULES, check_interleaving, check_virtual_stages, default_virtual_stages

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSSES = ("mse", "cross_entropy")
INITS = ("factory", "meta")
TRANSPORTS = ("auto", "dist")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_argument(parser, "train this plan file, written by gpipe plan --out or gpipe demo (the layout flags "
                              "override its values)")
    add_model_arguments(parser, costs=False)
    add_pipeline_arguments(parser, stages="the plan's, else 1", microbatches=4, recorded="the plan's")
    add_scale_out_arguments(parser, recorded="the plan's", sequence_parallel="the plan's, else off", context=False)
    what = parser.add_argument_group("what to train on, and how it starts")
    add_hardware_argument(what, use="the system whose analytic costs choose the partition when --partition is not "
                                    "given, as gpipe simulate does", files=False)
    what.add_argument("--loss", default=None, action=Checked, check=one_of("--loss", LOSSES),
                      help="loss (default: the model's)")
    add_data_argument(what, meaning="what to train on: synthetic random data (default; what calibration times), text "
                                    "(the shipped Shakespeare, one token per byte: a language model's loss falls), "
                                    "text:PATH (any file, byte by byte), or package.module:function(batch_size, "
                                    "step=, seed=) -> (inputs, targets)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--init", default=None, action=Checked, check=one_of("--init", INITS),
                      help="first weights: factory (default: exactly what the model's factory gives after "
                           "torch.manual_seed(--seed), built once per node by this command) or meta (built on "
                           "the meta device, each layer from reset_parameters() seeded per layer: for a model "
                           "larger than this host)")
    what.add_argument("--init-from", metavar="PATH",
                      help="start from these weights: a state dict, a safetensors file or a model folder "
                           "(each process reads only its own stage's tensors)")
    how = parser.add_argument_group("how to train")
    add_steps_argument(how, 10, "mini-batches (optimizer steps)")
    add_optimizer_argument(how, recorded="the plan's")
    how.add_argument("--lr", type=float, default=0.01, help="peak learning rate (default 0.01)")
    how.add_argument("--weight-decay", type=float, default=0.0,
                     help="torch.optim weight decay: L2 for sgd and adam, decoupled for adamw (default 0)")
    how.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
                     help="scale gradients so their L2 norm over all stages is at most MAX_NORM (default: off)")
    how.add_argument("--lr-schedule", default="constant", metavar="NAME",
                     help="constant (default) or cosine (decays to 0 over --steps after the warm-up)")
    how.add_argument("--lr-warmup", type=int, default=0, metavar="STEPS",
                     help="steps of linear learning-rate warm-up (default 0)")
    add_precision_argument(how, "the plan's, else fp32")
    add_device_argument(how, "cpu (gloo) or cuda (NCCL, one GPU per stage)")
    how.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / workers)")
    how.add_argument("--transport", default="auto", action=Checked, check=one_of("--transport", TRANSPORTS),
                     help="stage-to-stage messages: auto (shared memory between CPU ranks of one host, "
                          "torch.distributed otherwise; default) or dist (torch.distributed everywhere)")
    how.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck receive fails")
    how.add_argument("--warmup-steps", type=int, default=1, help="steps left out of step_time_s")
    out = parser.add_argument_group("outputs and checkpoints")
    add_json_argument(out, "print one JSON object on stdout and nothing else: the losses and step times, with --plan "
                           "the comparison with its prediction, and the files written (the ranks' lines go to stderr)")
    out.add_argument("--report", help="write the measured report JSON here")
    add_trace_argument(out)
    add_html_argument(out, "with --plan: write the report of this run against the plan's prediction (both "
                           "timelines on one axis, busy, bubble and memory per stage, losses, one verdict line)")
    out.add_argument("--save-every", type=int, default=0, help="save training state every N steps")
    out.add_argument("--checkpoint-dir", help="directory for --save-every and --resume")
    out.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    out.add_argument("--max-restarts", type=int, default=0,
                     help="torchrun restarts after a failure; each resumes from the last checkpoint")
    nodes = parser.add_argument_group("several nodes (every node runs gpipe train with the same flags)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes; each starts K / nnodes stages")
    nodes.add_argument("--node-rank", type=int, default=0,
                       help="this node, 0 to nnodes-1: node n runs stages n*K/nnodes onwards; node 0 holds "
                            "stage 0 and hosts the rendezvous")
    nodes.add_argument("--rdzv-endpoint",
                       help="node 0's HOST:PORT, reachable from every node (needed with --nnodes > 1)")
    nodes.add_argument("--rdzv-id", default="gpipe", help="rendezvous id shared by the nodes of one run")
    nodes.add_argument("--rdzv-timeout", type=int, default=300,
                       help="seconds the nodes wait for each other to start before giving up (default 300)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = model_options(args)
    for name in ANALYTIC_ONLY_OPTIONS:
        if name in options:
            flag = "--" + name.replace("_", "-")
            raise GpipeInputError(f"{flag} describes the simulator's analytic models; the executor trains "
                                  f"with the optimizer you choose, so drop {flag}")
    return options


def _data_source(data: str | None) -> str:
    """``--data`` as the workers read it: "" for synthetic, a ``text:PATH`` made absolute."""
    if not data or data == "synthetic":
        return ""
    if data.startswith("text:"):
        return "text:" + os.path.abspath(data[len("text:"):])
    return data


def check_flags(args: argparse.Namespace) -> None:
    """The flags that need no model, each refused in one line before torch is imported (a tenth of
    a second rather than two) and before any rank starts (a bad ``--timeout`` or ``--threads`` would
    otherwise fail inside every rank). A plan file's values are checked with the model."""
    for flag, name, value in (("--stages", "--stages", args.stages), ("--microbatches", "micro-batches (M)",
                                                                       args.microbatches),
                              ("--batch", "batch size", args.batch), ("--replicas", "--replicas", args.replicas),
                              ("--steps", "steps", args.steps)):
        if value is not None:
            require_positive(name, value, f"use {flag} 1 or more")
    for flag, value, meaning in (("--threads", args.threads, "0 (cores / workers)"),
                                 ("--warmup-steps", args.warmup_steps, "0 (every step measured)"),
                                 ("--max-restarts", args.max_restarts, "0 (none)")):
        if value < 0:
            raise GpipeInputError(f"{flag} must be {meaning} or more, got {value}")
    if args.zero is not None:
        check_zero(args.zero, shard_group=args.shard_group, gradient_sync=args.gradient_sync)
    from sim.catalog.user_systems import resolve_system

    resolve_system(hardware_of(args))  # an unknown --hardware is one line even where a plan or partition leaves it unused
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise GpipeInputError(f"--timeout must be a positive number of seconds, got {args.timeout}; a stuck "
                              "receive fails after it (default 300)")


def config_from_args(args: argparse.Namespace):
    """A validated :class:`RunConfig` from a plan file and/or flags (flags override the plan)."""
    check_flags(args)
    from executor.config import RunConfig
    from executor.models.build import model_ref

    extra = dict(steps=args.steps, seed=args.seed, loss=args.loss or "", lr=args.lr,
                 weight_decay=args.weight_decay, clip_grad_norm=args.clip_grad_norm,
                 lr_schedule=args.lr_schedule, lr_warmup_steps=args.lr_warmup,
                 data=_data_source(args.data), report=args.report or "", trace=args.trace or "",
                 save_every=args.save_every, checkpoint_dir=args.checkpoint_dir or "", resume=args.resume,
                 device=args.device, threads=args.threads, timeout_s=args.timeout, transport=args.transport,
                 warmup_steps=args.warmup_steps, progress=bars_shown(), quiet=bool(getattr(args, "quiet", False)),
                 init_from=os.path.abspath(args.init_from) if args.init_from else "")
    if args.optimizer is not None:  # else the plan's, or RunConfig's default
        extra["optimizer"] = args.optimizer
    if args.precision is not None:
        extra["precision"] = check_precision(args.precision, trained=True)
    if args.init is not None:
        if args.init_from:
            raise GpipeInputError(f"--init {args.init} and --init-from both say where the first weights come "
                                  "from; give one of them")
        extra["init"] = args.init
    if args.plan:
        plan = load_plan(args.plan)
        config = RunConfig.from_plan(plan, **extra)  # drops the analysis options
    else:
        if not args.model:
            raise GpipeInputError("say what to train: --plan plan.json, or --model NAME with --stages K")
        config = RunConfig.of(model=args.model, **extra)
    if args.model:
        config.model = args.model
    options = _options(args)
    if options or args.model:
        config.options = {**(config.options if not args.model else {}), **options}
    if is_named(config.model):  # a named model trains its own architecture, from its packaged config.json
        config.model = "hf-config:" + named_models()[config.model].config_path
    ref = model_ref(config.model, config.options, config.seed)
    config.options = dict(ref.options)
    degrees = flat_layout(config.layout)  # the plan's, or the defaults; the flags override them
    degrees.update({name: getattr(args, name) for name in LAYOUT_KEYS if getattr(args, name, None) is not None})
    if degrees["tensor_parallel"] == 1 and args.sequence_parallel is None:
        degrees["sequence_parallel"] = False  # a plan's, dropped with its tensor parallelism
    if args.virtual_stages is None and degrees["virtual_stages"] == 1:
        degrees["virtual_stages"] = default_virtual_stages(degrees["schedule"])  # as gpipe simulate defaults it
    check_virtual_stages(degrees["schedule"], degrees["virtual_stages"])
    chunks = degrees["virtual_stages"]  # layer groups per process: V under the multi-chunk schedules
    partition = config.partition
    if args.partition:
        partition = parse_partition(args.partition)
    elif args.stages or not partition:
        if degrees["schedule"] in MULTI_CHUNK_SCHEDULES:  # M is checked once the batch is known (RunConfig.validate)
            check_interleaving(args.stages or 1, args.stages or 1, chunks, ref.num_layers)
        partition = default_partition(config, degrees, ref.num_layers, args)
    if args.stages and len(partition) != args.stages * chunks:
        if chunks > 1:
            raise GpipeInputError(f"--partition has {len(partition)} chunks but --stages {args.stages} x "
                                  f"--virtual-stages {chunks} needs {args.stages * chunks}")
        raise GpipeInputError(f"--partition has {len(partition)} stages but --stages is {args.stages}")
    config.partition = tuple(partition)
    config.layout = ParallelLayout.for_partition(config.partition, **degrees)
    if args.batch is not None:
        config.batch_size = args.batch
    elif not args.plan:
        config.batch_size = _default_batch(config.model)
    config.plan(ref)  # validates partition, batch, M, schedule and policy with one-line errors
    return config.validate()


def default_partition(config, degrees: dict, num_layers: int, args: argparse.Namespace) -> tuple[int, ...]:
    """The partition ``gpipe simulate`` picks for the same flags, so predicted and measured runs
    split the model the same way; an even split for models the simulator has no analytic form of.
    Under the interleaved schedule the layers are split into V x K chunks. ``degrees``: the layout's
    flat keys as the flags and plan give them (:data:`sim.formats.layout.LAYOUT_KEYS`)."""
    from sim.workloads.models import BUILTIN_MODELS
    from sim.workloads.moe.workload import builtin_workload

    stages = (args.stages or 1) * degrees["virtual_stages"]
    partition = even_partition(num_layers, stages)  # also rejects more stages than layers
    if config.model not in BUILTIN_MODELS:
        return partition
    from sim.catalog.user_systems import resolve_system
    from sim.planner.search import Candidate
    from sim.planner.search import default_partition as simulator_partition

    batch = args.batch if args.batch is not None else (config.batch_size or _default_batch(config.model))
    candidate = Candidate(args.stages or 1, degrees["microbatches"], degrees["checkpoint"], degrees["schedule"],
                          degrees["replicas"], degrees["virtual_stages"], degrees["zero"], degrees["placement"])
    system = resolve_system(hardware_of(args))
    workload = builtin_workload(config.model, {**config.options, "precision": config.precision})
    try:
        return tuple(simulator_partition(workload, system, batch, candidate))
    except GpipeInputError:
        if args.hardware is not None:
            raise
        # the default system (this machine's CPU) has no peak for every precision the executor trains
        # in (bf16 autocast runs on any CPU); the split only weighs layers against each other, so the
        # ideal system's, as before the default was this machine, chooses it
        return tuple(simulator_partition(workload, resolve_system("ideal"), batch, candidate))


def check_checkpoint_dir(config) -> None:
    """Before any worker starts: a ``--checkpoint-dir`` to save to must be writable (a probe file is
    created and removed in it), and ``--resume`` needs a checkpoint there whose settings match.

    ``--resume`` from a directory with no checkpoint is refused rather than silently starting from
    step 0: the user asked to continue a run, and a wrong path would otherwise train from scratch.
    A torchrun restart (``--max-restarts``) that finds no checkpoint yet does start from step 0.
    """
    from executor.state import checkpoint

    root = config.checkpoint_dir
    if config.save_every:
        try:
            os.makedirs(root, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".gpipe-probe-", dir=root)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise GpipeInputError(f"--checkpoint-dir {root} cannot be written ({exc.strerror or exc}); give a "
                                  "directory this user can create and write") from None
    if config.resume:
        manifest = checkpoint.read_manifest(root) if os.path.isdir(root) else None
        if manifest is None:
            raise GpipeInputError(f"--resume but --checkpoint-dir {root} holds no checkpoint ({checkpoint.MANIFEST}); "
                                  "give the directory a run saved to with --save-every, or drop --resume to start "
                                  "from step 0")
        checkpoint.check_resumable(manifest, config.to_dict())
        checkpoint.check_shards(root, manifest)


def _default_batch(model: str) -> int:
    try:
        from sim.workloads.model_defaults import DEFAULT_BATCH
        return int(DEFAULT_BATCH.get(model, 32))
    except ImportError:
        return 32


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # the flags first, then the model (torch)
    from executor.device import device_api
    from executor.models.hf import is_hf, rank_imports
    from executor.runtime.pipeline import prepare

    check_nodes(args, config.world_size, config.layout.tensor_parallel)
    check_capacity(config.world_size, args.nnodes, config.device, os.cpu_count() or 1,
                   device_api(config.device).ranks_per_host())
    for flag, path in (("--report", config.report), ("--trace", config.trace)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise GpipeInputError(f"{flag} {path}: directory {os.path.dirname(os.path.abspath(path))} does not "
                                  "exist; create it first")
    if args.max_restarts and not config.checkpoint_dir:
        raise GpipeInputError("--max-restarts resumes from checkpoints; add --checkpoint-dir and --save-every")
    if args.html:
        from gpipe.options import check_output_path

        check_output_path(args.html, "--html")
        if not args.plan:
            raise GpipeInputError("--html compares the run with its plan's prediction; give --plan FILE (written "
                                  "by gpipe plan --out or gpipe demo)")
    # before the fork server, whose imports would load the machine while the speed probe times it
    comparison = plan_comparison(args, config) if args.plan and args.node_rank == 0 else None
    # it imports the executor (and a Hugging Face model's code) for the ranks while this process checks the model
    start_fork_server(rank_imports(config.model, config.options) if is_hf(config.model) else ())
    prepared = prepare(config)  # a bad model or partition fails here, before any process starts
    check_checkpoint_dir(config)
    from executor.transport.shm_transport import SHM_DIR_ENV, shared_directory

    workdir = tempfile.mkdtemp(prefix="gpipe-train-")
    with shared_directory() as shared:  # the ranks' message files (executor.transport.shm_transport)
        try:
            if config.init == "factory" and not config.init_from:
                from executor.models.initial_weights import save_factory_weights

                config.factory_weights = save_factory_weights(config.model, config.options, config.seed,
                                                              prepared.model, os.path.join(workdir, "factory-weights"))
            del prepared
            asked_report = config.report
            if (comparison is not None or args.json) and not config.report:  # the comparison and --json read it
                config.report = os.path.join(workdir, "report.json")
            config_path = os.path.join(workdir, "config.json")
            config.save(config_path)
            error_dir = os.path.join(workdir, "errors")
            os.makedirs(error_dir)
            env = dict(os.environ, GPIPE_ERROR_DIR=error_dir, **{SHM_DIR_ENV: shared})
            env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.getcwd(), env.get("PYTHONPATH")) if p)
            per_node = config.world_size // args.nnodes
            env.setdefault("OMP_NUM_THREADS", str(config.threads or max(1, (os.cpu_count() or 1) // per_node)))
            # with --json the ranks' lines (losses, the last line) go to stderr: stdout holds the one object
            code, message = run_ranks("executor.launch.worker", [config_path], config.world_size, env, error_dir, args,
                                      stdout_fd=2 if args.json else 1)
            if code != 0:
                print(message, file=sys.stderr)
                return code
            report = read_report(config.report, args.data) if os.path.exists(config.report) else None
            verdict = comparison.finish(report) if comparison is not None and report is not None else None
            if args.json:
                json.dump(run_summary(config, report, comparison, verdict, asked_report, args), sys.stdout)
                print()
            elif verdict is not None:
                print(verdict, flush=True)
            return code
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def run_summary(config, report: dict[str, Any] | None, comparison, verdict: str | None, report_path: str,
                args: argparse.Namespace) -> dict[str, Any]:
    """``--json``'s object: what ran (the plan as trained), each step's loss and time, with ``--plan``
    the verdict against its prediction, and the files written. A node other than node 0 that wrote
    no report of its own has no losses or times to give (None)."""
    measured = report or {}
    compared = None
    if comparison is not None:
        compared = {"verdict": verdict, "plan": args.plan, "predicted_step_s": comparison.predicted_step_s,
                    "measured_step_s": measured.get("step_time_s"), "re_predicted_for": list(comparison.changes)}
    return {"steps": config.steps, "node_rank": args.node_rank, "plan": measured.get("plan"),
            "losses": measured.get("losses"), "grad_norms": measured.get("grad_norms"),
            "step_time_s": measured.get("step_time_s"), "step_times_s": measured.get("step_times_s"),
            "measured_steps": measured.get("measured_steps"), "comparison": compared,
            "report": report_path or None, "trace": config.trace or None, "html": args.html,
            "checkpoint_dir": config.checkpoint_dir or None}


def plan_comparison(args: argparse.Namespace, config):
    """What compares the run with its plan's prediction afterwards (:mod:`calibrate.report.run_report`); made
    before any worker starts, so a missing costs file with --html is one line then."""
    from calibrate.report.run_report import PlanComparison
    from executor.models.build import model_ref
    from gpipe.simulate import predict_plan

    trained = config.plan(model_ref(config.model, config.options, config.seed))
    return PlanComparison(args.plan, load_plan(args.plan), trained, config.device, args.html, predict_plan)


def read_report(path: str, data: str | None) -> dict[str, Any]:
    """The run's report as rank 0 wrote it, with what it trained on (for the report's loss curve)."""
    with open(path) as handle:
        report = json.load(handle)
    report["data"] = "text" if data == "text" else ("synthetic" if not data or data == "synthetic" else data)
    return report
