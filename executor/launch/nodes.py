"""What the nodes of one run must agree on, and where the report and trace go.

Every node runs its own ``gpipe train``, so every node has its own :class:`RunConfig`. Right after
the process group starts, each rank shares its node's settings (:func:`share`):

* :func:`check_same_settings` refuses a run whose nodes were started with different settings (a
  pipeline whose stages disagree on ``--steps`` or ``--lr`` would hang or train something else),
  with one line naming the node and the setting. Paths that are a node's own business
  (:data:`PER_NODE`) may differ.
* :func:`output_writers` finds the nodes other than node 0 that were given ``--report`` or
  ``--trace``: rank 0 (node 0, stage 0) builds the report, writes its own node's files and sends
  the report to the first rank of each such node, which writes it there (:func:`send_outputs`,
  :func:`receive_outputs`). So the report appears where the user asked for it, on any node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from executor.config import RunConfig
from sim.errors import GpipeInputError
from sim.formats.timeline import Timeline, write_json_atomic

# settings that are each node's own: output paths, thread count, where the weights file is mounted
PER_NODE = ("report", "trace", "threads", "init_from", "factory_weights", "progress", "quiet")


@dataclass
class NodeView:
    """One rank's node and its node's settings, as shared at start."""

    rank: int
    node: int
    settings: dict[str, Any]


def share(config: RunConfig, node: int) -> list[NodeView]:
    """Every rank's node and settings (a collective: every rank calls it once, at start)."""
    mine = (node, config.to_dict())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [NodeView(rank, n, settings) for rank, (n, settings) in enumerate(gathered)]


def check_same_settings(views: list[NodeView]) -> None:
    """Raise one line when a node was started with other settings than node 0."""
    reference = views[0]
    for view in views[1:]:
        for key, value in view.settings.items():
            if key in PER_NODE or reference.settings.get(key) == value:
                continue
            raise GpipeInputError(f"node {view.node} was started with {key} = {value!r} but node "
                                  f"{reference.node} with {reference.settings.get(key)!r}; start every node's "
                                  "gpipe train with the same flags")


def output_writers(views: list[NodeView]) -> dict[int, tuple[str, str]]:
    """``{rank: (report, trace)}``: the first rank of each node but rank 0's that asked for either."""
    writers: dict[int, tuple[str, str]] = {}
    seen = {views[0].node}
    for view in views:
        if view.node in seen:
            continue
        seen.add(view.node)
        report, trace = view.settings.get("report", ""), view.settings.get("trace", "")
        if report or trace:
            writers[view.rank] = (report, trace)
    return writers


def write_outputs(report: dict[str, Any], report_path: str, trace_path: str) -> None:
    if report_path:
        write_json_atomic(report_path, report)
    if trace_path:
        Timeline.from_dict(report["timeline"]).write_chrome_trace(trace_path)


def send_outputs(report: dict[str, Any], writers: dict[int, tuple[str, str]]) -> None:
    """On rank 0: the report to each writer (one object each, over the default group)."""
    for rank in sorted(writers):
        dist.send_object_list([report], dst=rank)


def receive_outputs(writer: tuple[str, str]) -> dict[str, Any]:
    """On a writer: the report from rank 0, written to this node's ``--report`` and ``--trace``."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=0)
    write_outputs(box[0], *writer)
    return box[0]
