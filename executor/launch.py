"""Start this node's torchrun, and say why the run failed when it did.

One node: ``torchrun --standalone --nproc-per-node K``. Several nodes: every node runs ``gpipe
train`` with its ``--node-rank`` and node 0's address as ``--rdzv-endpoint``, and this module
starts ``torchrun --nnodes N --node-rank n --nproc-per-node K/N --rdzv-backend static
--rdzv-endpoint HOST:PORT --rdzv-conf timeout=T``.

Why the static rendezvous rather than c10d: the executor needs rank == stage, and node n's workers
to be stages n*K/N .. n*K/N + K/N - 1, so that node 0 holds stage 0 (which writes ``--report`` and
``--trace``) whatever order the nodes start in. c10d numbers nodes in the order they join and
ignores ``--node-rank``; the workers could renumber themselves from (node rank, local rank), but
then every rank torchrun prints (its failure summary, its log prefixes) would disagree with the
executor's, and two nodes given the same ``--node-rank`` would only be found inside the workers.
The static rendezvous takes the node rank as given, so torchrun's ``RANK`` is the stage; node 0's
agent hosts the store at the endpoint and the others connect to it, retrying, so the order of
starting does not matter; a node that never comes ends the others after ``--rdzv-timeout``. What
static gives up is elasticity (a fixed node count; a pipeline cannot lose a stage anyway) and
coordinated restarts: with ``--max-restarts`` each node restarts its workers when they fail, which
they all do when any stage fails (see :mod:`executor.failures`), so the attempts stay in step.

How a failure on one node reaches the others is in :mod:`executor.failures`; this side adds what
only the launching process knows: that a worker was killed by a signal (from torchrun's summary),
which it writes to the store for the other nodes.
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import threading

from executor.failures import FailureRecord, local_records, pick_failure, post_to
from sim.errors import GpipeInputError, require_positive

# torchrun's failure summary: the root cause's rank and exit code (negative: killed by a signal)
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_LAST_ERROR = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Timeout)\w*): (.+)$")


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
    if args.nnodes > 1:
        if not 0 <= args.node_rank < args.nnodes:
            raise GpipeInputError(f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}; "
                                  f"number the nodes 0 to {args.nnodes - 1}, node 0 at the --rdzv-endpoint")
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


def torchrun_command(config_path: str, stages: int, args: argparse.Namespace) -> list[str]:
    """The torchrun command line that starts this node's workers (``stages`` / nnodes of them;
    ``stages`` is the run's ranks, D replicas x K stages)."""
    check_nodes(args, stages)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages // args.nnodes),
               "--max-restarts", str(args.max_restarts), "--monitor-interval", "0.2"]
    if args.nnodes == 1:
        command.append("--standalone")
    else:
        host, port = endpoint(args.rdzv_endpoint)
        command += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "static",
                    "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", args.rdzv_id,
                    "--rdzv-conf", f"timeout={int(args.rdzv_timeout)}"]
    return command + ["-m", "executor.worker", config_path]


def killed_by_signal(torchrun_output: str, node: int) -> FailureRecord | None:
    """The rank torchrun's summary names as the root cause, when a signal ended it."""
    match = _ROOT_CAUSE.search(torchrun_output)
    if not match or int(match.group(2)) >= 0:
        return None
    number = -int(match.group(2))
    try:
        name = f" ({signal.Signals(number).name})"
    except ValueError:
        name = ""
    return FailureRecord(node, int(match.group(1)), f"killed by signal {number}{name}")


def torchrun_error(torchrun_output: str) -> str | None:
    """The last ``SomeError: message`` line torchrun printed (its own failure, not a worker's)."""
    for line in reversed(torchrun_output.splitlines()):
        match = _LAST_ERROR.match(line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2)}"
    return None


def _tee(stream, sink, tail: collections.deque) -> None:
    """Copy torchrun's stderr (its workers' too) through, keeping the last lines."""
    out = getattr(sink, "buffer", None)
    for line in iter(stream.readline, b""):
        tail.append(line)
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sink.write(line.decode(errors="replace"))


def run_torchrun(command: list[str], env: dict[str, str], error_dir: str,
                 args: argparse.Namespace) -> tuple[int, str | None]:
    """Run torchrun; on failure return its exit code and the line ``gpipe train`` prints.

    With several nodes, a failure that happened here is also written to the rendezvous store
    (node 0's, while it lasts) so the other nodes' workers stop with its message.
    """
    tail: collections.deque = collections.deque(maxlen=500)
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    reader = threading.Thread(target=_tee, args=(process.stderr, sys.stderr, tail), daemon=True)
    reader.start()
    code = process.wait()
    reader.join(timeout=5)
    if code == 0:
        return 0, None
    output = b"".join(tail).decode(errors="replace")
    killed = killed_by_signal(output, args.node_rank)
    failure = pick_failure(local_records(error_dir), killed)
    if failure is None:
        error = torchrun_error(output)
        hint = ("; check that every node was started with the same flags and --nnodes, node 0's address as "
                "--rdzv-endpoint and a distinct --node-rank, within --rdzv-timeout") if args.nnodes > 1 else ""
        detail = f"torchrun failed ({error.rstrip('.')}){hint}" if error else \
            "a worker died without an error message; see torchrun's output above"
        return code, f"gpipe: error: training failed: {detail}"
    if args.nnodes > 1 and failure is killed:  # a killed worker could not write it itself
        post_to(endpoint(args.rdzv_endpoint), args.max_restarts, failure)  # the last attempt's
    where = failure.describe(args.node_rank)
    return code, f"gpipe: error: training failed{' ' if where.startswith('on node') else ': '}{where}"
