"""How a failure in one process ends the run on every node, with the original error shown.

Every process of a run, on every node, reaches the rendezvous store (the ``TCPStore`` torchrun's
agent on node 0 hosts at ``MASTER_ADDR:MASTER_PORT``). The first failure of an attempt is written
there once, under :func:`failure_key` (first writer wins: ``compare_set``), as a
:class:`FailureRecord`. Each worker runs a :class:`Watchdog` thread that polls that key every
``poll_s``; when another rank's failure appears it prints it, records it for ``gpipe train`` and
ends its own process at once (``os._exit``: the main thread may be blocked in a collective). A
store that stays unreachable for ``lost_after_s`` means node 0's agent is gone, so the run is over
too.

Who writes the failure, so that the original error wins over its consequences:

* a worker that raises writes its own error before it exits (its peers only fail after it exits,
  when their sockets close, so the original is always first);
* a worker whose error is only the loss of a peer (:func:`is_peer_loss`: a closed connection) waits
  up to ``PEER_LOSS_GRACE_S`` for the cause to be written by someone else before writing its own;
* a worker killed by a signal writes nothing; ``gpipe train`` on its node learns it from the agent
  (its ``ChildFailedError``) once the ranks have ended and writes ``killed by signal 9 (SIGKILL)``
  for it (``executor.launch.agent``),
  while the other nodes' workers, which lost it as a peer, are still waiting for it.

Every worker also keeps a local record of what it saw (``$GPIPE_ERROR_DIR/rank-R.json``), from
which ``gpipe train`` picks the message it prints (:func:`pick_failure`).

Limits: the classification of a peer's loss reads the exception's message (gloo and NCCL do not
raise a dedicated type); a node that vanishes without closing its sockets (power loss, a network
partition) is noticed by the store's ``lost_after_s`` when it is node 0 and otherwise by the
process-group timeout (``--timeout``); a hang that raises nothing is ended by that timeout only.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sim.formats.timeline import write_json_atomic

PEER_LOSS_GRACE_S = 10.0  # how long a worker that lost a peer waits for the peer's own error
STORE_TIMEOUT_S = 5.0  # one store operation of the watchdog; also how long a post may take

# what gloo and NCCL say when the process at the other end of a connection has gone
_PEER_LOSS = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused|"
                        r"ECONNRESET|EPIPE|NCCL communicator was aborted|remote process exited", re.IGNORECASE)

# record kinds, in the order gpipe train prefers them
RAISED = "raised"  # this rank's own error
REMOTE = "remote"  # another rank's error, read from the store by the watchdog
PEER = "peer"  # a lost connection, when no other rank's error appeared in time


@dataclass
class FailureRecord:
    """One failure: where it happened (``rank`` None: a whole node, e.g. node 0's store went away)."""

    node: int
    rank: int | None
    message: str
    kind: str = RAISED

    def where(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"node {self.node}"

    def describe(self, this_node: int) -> str:
        """``rank R: message``, prefixed by ``on node N:`` when it happened on another node."""
        text = f"{self.where()}: {self.message}" if self.rank is not None else self.message
        return text if self.node == this_node else f"on node {self.node}: {text}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        data = json.loads(text)
        return cls(int(data["node"]), data["rank"], str(data["message"]), str(data.get("kind", RAISED)))


def failure_key(attempt: int) -> str:
    """The store key of an attempt's first failure; a torchrun restart starts a clean attempt."""
    return f"gpipe/attempt-{attempt}/failure"


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` only says that the process at the other end went away."""
    return bool(_PEER_LOSS.search(str(exc)))


def connect(host: str, port: int, timeout_s: float = STORE_TIMEOUT_S):
    """A client of the store at ``host:port``; it does not count as a node joining the rendezvous.

    A plain socket tries the port first (raising ``OSError`` at once when nothing listens): a
    TCPStore client would retry a closed port, logging each try, for ``timeout_s``.
    """
    import torch.distributed as dist

    socket.create_connection((host, port), timeout=1.0).close()
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def post(store, attempt: int, record: FailureRecord) -> FailureRecord:
    """Write ``record`` unless a failure is already there; return the one that stands."""
    key = failure_key(attempt)
    value = record.to_json()
    current = store.compare_set(key, "", value)
    return FailureRecord.from_json(current) if current else record


def post_to(endpoint: tuple[str, int], attempt: int, record: FailureRecord) -> bool:
    """:func:`post` through a new connection; False when the store cannot be reached (it is gone)."""
    try:
        post(connect(*endpoint), attempt, record)
        return True
    except Exception:  # the store's host has exited: nobody is left to tell
        return False


def record_locally(record: FailureRecord) -> None:
    """Keep ``record`` for ``gpipe train`` on this node (``$GPIPE_ERROR_DIR/rank-R.json``)."""
    directory = os.environ.get("GPIPE_ERROR_DIR")
    if not directory:
        return
    data = {**asdict(record), "reported_by": int(os.environ.get("RANK", "0")), "time": time.time()}
    try:
        write_json_atomic(os.path.join(directory, f"rank-{data['reported_by']}.json"), data)
    except OSError:
        pass


def local_records(directory: str) -> list[FailureRecord]:
    """The records the workers of this node left, oldest first."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as handle:
                data = json.load(handle)
            found.append((data.get("time", 0.0), FailureRecord.from_json(json.dumps(data))))
    return [record for _, record in sorted(found, key=lambda pair: pair[0])]


def pick_failure(records: list[FailureRecord], killed: FailureRecord | None) -> FailureRecord | None:
    """The failure ``gpipe train`` reports: a rank's own error first, then a rank torchrun saw
    killed by a signal, then another node's failure, then a lost connection."""
    raised = [record for record in records if record.kind == RAISED]
    if raised or killed is not None:
        return raised[0] if raised else killed
    for kind in (REMOTE, PEER):
        for record in records:
            if record.kind == kind:
                return record
    return None


class Watchdog:
    """Ends this worker when another rank's failure appears in the store, or the store is gone.

    ``rank``/``node``: this process; ``attempt``: torchrun's restart count; ``abort`` is called with
    the failure and must not return (by default it prints, records and ``os._exit(1)``\\ s).
    """

    def __init__(self, endpoint: tuple[str, int], rank: int, node: int, attempt: int, poll_s: float = 0.5,
                 lost_after_s: float = 5.0, abort: Callable[[FailureRecord], Any] | None = None) -> None:
        self.endpoint = endpoint
        self.rank, self.node, self.attempt = rank, node, attempt
        self.poll_s, self.lost_after_s = poll_s, lost_after_s
        self.abort = abort or self._exit
        self._store: Any = None
        self._lock = threading.Lock()  # the store client is shared with post()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpipe-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STORE_TIMEOUT_S + self.poll_s)

    def post(self, record: FailureRecord) -> FailureRecord:
        """Write this rank's failure (first writer wins); the one that stands is returned."""
        with self._lock:
            if self._store is None:
                self._store = connect(*self.endpoint)
            return post(self._store, self.attempt, record)

    def check(self) -> FailureRecord | None:
        """Another rank's failure, if one was written; raises when the store cannot be reached."""
        key = failure_key(self.attempt)
        with self._lock:
            if self._store is None:
                self._store = connect(*self.endpoint)
            if not self._store.check([key]):
                return None
            record = FailureRecord.from_json(self._store.get(key))
        return None if record.rank == self.rank else record

    def _run(self) -> None:
        last_reached = time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                record = self.check()
                last_reached = time.monotonic()
            except Exception:
                with self._lock:
                    self._store = None
                if time.monotonic() - last_reached < self.lost_after_s:
                    continue
                host, port = self.endpoint
                record = FailureRecord(0, None, f"lost contact with its rendezvous store at {host}:{port} "
                                                "(its gpipe train exited, or the network is down)", REMOTE)
            if record is not None and not self._stop.is_set():
                self.abort(record)
                return

    def _exit(self, record: FailureRecord) -> None:
        record.kind = REMOTE
        record_locally(record)
        what = record.describe(self.node)
        cause = f"the run failed {what}" if what.startswith("on node") else f"{record.where()} failed: {record.message}"
        print(f"gpipe: error: rank {self.rank} stopped, {cause}", file=sys.stderr, flush=True)
        os._exit(1)
