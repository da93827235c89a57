"""Run this node's ranks under torchrun's agent, inside this process, and say why the run failed when it did.

The agent is torchrun's own (``torch.distributed.launcher.api.elastic_launch``: rendezvous,
restarts, failure detection), run here instead of as ``python -m torch.distributed.run``, and it
forks each rank from a fork server that has imported the executor once (see
:mod:`executor.launch.rank_process`, which makes the fork the ``python -u -m MODULE`` torchrun would have
started). A launch thereby skips torchrun's import of torch before any rank starts and each rank's
own imports, seconds of a core each (docs/notes/2026-11-26-launch-time.md); a second launch from the
same process (a calibration, a notebook, the tests) reuses the fork server.

One node: the agent as ``torchrun --standalone --nproc-per-node K``. Several nodes: every node runs
``gpipe train`` with its ``--node-rank`` and node 0's address as ``--rdzv-endpoint``, and its agent
uses the static rendezvous with that node rank (torchrun's ``--rdzv-backend static``).

Why the static rendezvous rather than c10d: the executor needs rank == stage, and node n's workers
to be stages n*K/N .. n*K/N + K/N - 1, so that node 0 holds stage 0 (which writes ``--report`` and
``--trace``) whatever order the nodes start in. c10d numbers nodes in the order they join and
ignores the node rank; the workers could renumber themselves from (node rank, local rank), but
then every rank the agent reports (its failures, its log lines) would disagree with the executor's,
and two nodes given the same ``--node-rank`` would only be found inside the workers. The static
rendezvous takes the node rank as given, so the agent's ``RANK`` is the stage; node 0's agent
hosts the store at the endpoint and the others connect to it, retrying, so the order of starting
does not matter; a node that never comes ends the others after ``--rdzv-timeout``. What static
gives up is elasticity (a fixed node count; a pipeline cannot lose a stage anyway) and coordinated
restarts: with ``--max-restarts`` each node restarts its workers when they fail, which they all do
when any stage fails (see :mod:`executor.launch.failures`), so the attempts stay in step.

How a failure on one node reaches the others is in :mod:`executor.launch.failures`; this side adds what
only the launching process knows: that a worker was killed by a signal (the agent's
``ChildFailedError``), which it writes to the store for the other nodes.

Limits: the launching process must be able to start a fork server (``multiprocessing``'s
``forkserver``: Linux and macOS); while the ranks run, the agent handles SIGTERM, SIGINT, SIGHUP and
SIGQUIT in this process (it ends the ranks, then :func:`run_ranks` returns); the handlers before
the launch are restored after it.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.machinery
import multiprocessing
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from executor.launch.failures import FailureRecord, local_records, pick_failure, post_to
from sim.errors import GpipeInputError, require_positive

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

MONITOR_INTERVAL_S = 0.2  # how often the agent looks at its ranks (torchrun's default is 0.1 s)
# what the fork server imports once for every rank it will fork (a rank of any module built on the executor)
FORK_SERVER_PRELOAD = ["executor.launch.rank_process", "executor.launch.fork_server_preload"]
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the agent's, restored after a launch


def endpoint(text: str | None) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` too) as (host, port); one line when malformed."""
    if not text:
        raise GpipeInputError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, node 0's address, that every node "
                              "can reach (e.g. --rdzv-endpoint 10.0.0.1:29500)")
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GpipeInputError(f"--rdzv-endpoint {text!r} is not HOST:PORT; give node 0's address and a free "
                              "port, e.g. 10.0.0.1:29500")
    return host, int(port)


def check_nodes(args: argparse.Namespace, stages: int, tensor_parallel: int = 1) -> None:
    """The node flags, checked before anything starts (one line each); ``stages`` is the run's ranks
    (D replicas x K stages x T tensor-parallel ranks), and a stage's T ranks must share a node (their
    collectives run after every layer)."""
    require_positive("--nnodes", args.nnodes)
    if stages % args.nnodes:
        raise GpipeInputError(f"{stages} ranks (replicas x stages) do not split over --nnodes {args.nnodes}; "
                              "use a node count that divides them")
    if (stages // args.nnodes) % tensor_parallel:
        raise GpipeInputError(f"{stages // args.nnodes} ranks per node do not hold whole groups of --tensor-parallel "
                              f"{tensor_parallel}: a stage's tensor-parallel ranks must share a node; use fewer nodes")
    if args.nnodes == 1 and args.node_rank != 0:
        raise GpipeInputError(f"--node-rank {args.node_rank} names a node of several, but --nnodes is 1; leave "
                              "--node-rank out, or give every node --nnodes N and node 0's --rdzv-endpoint")
    if not 0 <= args.node_rank < args.nnodes:
        raise GpipeInputError(f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}; "
                              f"number the nodes 0 to {args.nnodes - 1}, node 0 at the --rdzv-endpoint")
    if args.nnodes > 1:
        require_positive("--rdzv-timeout", args.rdzv_timeout)
        endpoint(args.rdzv_endpoint)


# A CPU run may oversubscribe its cores (gloo ranks share them, each with one torch thread) up to
# this many ranks per core: enough for correctness runs such as 2 replicas x 2 stages on 2 cores.
CPU_RANKS_PER_CORE = 4


def check_capacity(ranks: int, nnodes: int, device: str, cores: int, gpus: int) -> None:
    """Refuse, in one line, more ranks per node than this machine runs: with ``--device cuda`` one
    rank per GPU (``gpus``, as torch counts them: NCCL cannot share a GPU between two ranks); on cpu
    :data:`CPU_RANKS_PER_CORE` per core (``cores``, ``os.cpu_count()``). Each node checks its own."""
    per_node = ranks // max(1, nnodes)
    where = "this node" if nnodes > 1 else "this machine"
    if device == "cuda" and per_node > gpus:
        raise GpipeInputError(f"{per_node} ranks (replicas x stages / nodes) need {per_node} GPUs but {where} has "
                              f"{gpus}; use fewer --replicas or --stages, or more --nnodes")
    if device == "cpu" and per_node > CPU_RANKS_PER_CORE * cores:
        raise GpipeInputError(f"{per_node} ranks (replicas x stages / nodes) are more than {where}'s {cores} cores "
                              f"run ({CPU_RANKS_PER_CORE} per core, at most {CPU_RANKS_PER_CORE * cores}); use "
                              "fewer --replicas or --stages, or more --nnodes")


def launch_config(ranks: int, args: argparse.Namespace) -> LaunchConfig:
    """This node's agent's settings for ``ranks`` / nnodes workers (``ranks`` is the run's ranks, D
    replicas x K stages x T) from ``gpipe train``'s flags, as ``torchrun --standalone`` would have
    them or, with several nodes, ``torchrun --rdzv-backend static --node-rank n``."""
    check_nodes(args, ranks)
    if args.nnodes == 1:
        return agent_config(ranks, max_restarts=args.max_restarts)
    host, port = endpoint(args.rdzv_endpoint)
    return agent_config(ranks // args.nnodes, args.max_restarts, args.nnodes, args.node_rank, f"{host}:{port}",
                        args.rdzv_id, int(args.rdzv_timeout))


def agent_config(ranks_here: int, max_restarts: int = 0, nnodes: int = 1, node_rank: int = 0,
                 rendezvous_at: str = "", run_id: str = "", rendezvous_timeout_s: int = 900) -> LaunchConfig:
    """The agent's settings for ``ranks_here`` ranks on this node: one node alone (c10d on a free
    local port, ``--standalone``), or node ``node_rank`` of ``nnodes`` meeting at ``rendezvous_at``
    (``HOST:PORT``) in the static rendezvous."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    if nnodes == 1:
        backend, where, run_id, rendezvous = "c10d", "localhost:0", uuid.uuid4().hex, {}
    else:
        backend, where, rendezvous = "static", rendezvous_at, {"timeout": rendezvous_timeout_s, "rank": node_rank}
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=ranks_here, run_id=run_id,
                        role="default", rdzv_endpoint=where, rdzv_backend=backend, rdzv_configs=rendezvous,
                        max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL_S, start_method="forkserver",
                        logs_specs=DefaultLogsSpecs())


@dataclass
class LaunchOutcome:
    """How the ranks ended: all well (``failed`` False), a rank's root failure (``rank`` and its
    ``exitcode``, negative for a signal), or the agent's own error (``agent_error``, e.g. a
    rendezvous that timed out) or a signal that stopped the launch (``stopped_by``)."""

    failed: bool = False
    rank: int | None = None
    exitcode: int | None = None
    agent_error: str | None = None
    stopped_by: int | None = None


def start_fork_server(preload: Sequence[str] = ()) -> None:
    """Start this process's fork server with the executor imported, and the modules in ``preload``
    (what the run's model needs on top: :func:`executor.models.hf.rank_imports`), unless one already runs
    (a server started without them still works: its ranks import what they need; a module that
    fails to import is skipped by the server and fails, with its reason, in the rank)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the one ``multiprocessing`` keeps per process
    first = server._forkserver_pid is None
    if first:
        multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD + list(preload))
    server.ensure_running()  # also starts a new one if the last has died
    if first:
        atexit.register(_stop_fork_server, server)


def _stop_fork_server(server) -> None:
    """End the fork server with this process: left alone it notices only after this process has
    gone and then spends about a second unloading torch, holding this process's output open (a
    caller reading that output to its end waits for it)."""
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)  # a fork server has no handler for it: it ends at once
        os.waitpid(pid, 0)
    except OSError:
        pass


def launch(config: LaunchConfig, module: str, argv: list[str], env: dict[str, str], stdout_fd: int = 1,
           stderr_fd: int = 2, timeout_s: float | None = None) -> LaunchOutcome:
    """Run ``python -u -m module *argv`` as this node's ranks under the agent ``config`` describes,
    with environment ``env``, this process's working directory, and output to ``stdout_fd`` /
    ``stderr_fd``; each rank ends itself after ``timeout_s`` (see :func:`executor.launch.rank_process.run_module`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from executor.launch.rank_process import InheritedFd, run_module

    start_fork_server()
    main = sys.modules["__main__"]
    main_spec = getattr(main, "__spec__", None)
    # ``multiprocessing`` makes a started process import the launching script (as ``__mp_main__``);
    # a rank of ``python -m MODULE`` never did, so the launching script passes for one that need not be
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED_SIGNALS if hasattr(signal, name)}
    saved = dict(os.environ)  # the agent sets variables of its own in this process
    try:
        elastic_launch(config, run_module)(module, list(argv), dict(env), os.getcwd(), InheritedFd(stdout_fd),
                                           InheritedFd(stderr_fd), timeout_s)
        return LaunchOutcome()
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        return LaunchOutcome(True, rank, failure.exitcode)
    except SignalException as exc:
        return LaunchOutcome(True, stopped_by=int(exc.sigval))
    except Exception as exc:  # the agent's own: a rendezvous that failed or timed out, a bad endpoint
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        return LaunchOutcome(True, agent_error=text)
    finally:
        main.__spec__ = main_spec
        os.environ.clear()
        os.environ.update(saved)
        try:
            for name, handler in handlers.items():
                signal.signal(getattr(signal, name), handler if handler is not None else signal.SIG_DFL)
        except ValueError:  # not the main thread: the agent set none either
            pass


def launch_captured(module: str, argv: list[str], ranks: int, env: dict[str, str],
                    timeout_s: float | None = None) -> tuple[LaunchOutcome, str]:
    """Run ``module`` as ``ranks`` ranks on this machine alone, their output (standard output and
    error, interleaved as written) kept and returned with the outcome instead of shown."""
    with tempfile.TemporaryFile() as output:
        outcome = launch(agent_config(ranks), module, argv, env, output.fileno(), output.fileno(), timeout_s)
        output.seek(0)
        return outcome, output.read().decode(errors="replace")


def killed_by_signal(outcome: LaunchOutcome, node: int) -> FailureRecord | None:
    """The root failure's rank, when a signal ended it."""
    if outcome.exitcode is None or outcome.exitcode >= 0 or outcome.rank is None:
        return None
    number = -outcome.exitcode
    try:
        name = f" ({signal.Signals(number).name})"
    except ValueError:
        name = ""
    return FailureRecord(node, outcome.rank, f"killed by signal {number}{name}")


def run_ranks(module: str, argv: list[str], ranks: int, env: dict[str, str], error_dir: str,
              args: argparse.Namespace, stdout_fd: int = 1) -> tuple[int, str | None]:
    """Run ``module`` as this node's ranks, their standard output to ``stdout_fd``; on failure
    return the exit code for ``gpipe train`` and the line it prints.

    With several nodes, a failure that happened here is also written to the rendezvous store
    (node 0's, while it lasts) so the other nodes' workers stop with its message.
    """
    outcome = launch(launch_config(ranks, args), module, argv, env, stdout_fd)
    if not outcome.failed:
        return 0, None
    if outcome.stopped_by is not None:
        name = signal.Signals(outcome.stopped_by).name
        return 128 + outcome.stopped_by, f"gpipe: error: training stopped by {name}; its ranks were ended"
    killed = killed_by_signal(outcome, args.node_rank)
    failure = pick_failure(local_records(error_dir), killed)
    if failure is None:
        hint = ("; check that every node was started with the same flags and --nnodes, node 0's address as "
                "--rdzv-endpoint and a distinct --node-rank, within --rdzv-timeout") if args.nnodes > 1 else ""
        detail = f"the launch failed ({outcome.agent_error.rstrip('.')}){hint}" if outcome.agent_error else \
            f"rank {outcome.rank} exited with code {outcome.exitcode} without an error message; see its output above"
        return 1, f"gpipe: error: training failed: {detail}"
    if args.nnodes > 1 and failure is killed:  # a killed worker could not write it itself
        post_to(endpoint(args.rdzv_endpoint), args.max_restarts, failure)  # the last attempt's
    where = failure.describe(args.node_rank)
    return 1, f"gpipe: error: training failed{' ' if where.startswith('on node') else ': '}{where}"
