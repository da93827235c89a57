"""Expert parallelism priced from a costs file: what E changes in a measured mixture-of-experts block.

Calibration times every block whole as one process runs it (every routed expert on its rank) and, apart,
each block's routed experts alone, per assignment routed (the costs file's ``experts`` entry,
:mod:`calibrate.measure.expert_profile`), and the all-to-all among E ranks (its ``expert_parallel`` entry,
:mod:`calibrate.measure.ep_collectives`). Under ``--expert-parallel E`` each rank
(:mod:`executor.parallel.expert_exchange`) runs its n/E experts over the assignments every rank of its group
sends them, one call per (source rank, expert), each of the rows one process's call has. So:

- what E does not change is priced as measured: the router, the attention, the norms, the shared
  experts, and the routed experts' mean work (a rank's own tokens x top_k assignments);
- the routed experts' time grows by the most loaded rank's excess, which every rank waits for at the
  combine: ``(load - 1) x per_assignment_s x assignments`` per pass, ``load`` the expected maximum
  over the mean (:func:`sim.workloads.moe.layers.expected_max_load`, the E ranks as the bins, the group's
  tokens as the balls), ``per_assignment_s`` the fitted slope of that pass at the run's thread count;
  it joins the profiled time before the in-pipeline lines scale it, as the rest of the block;
- each forward (and recompute) runs three all-to-alls: the per-expert counts (n integers), the dispatch
  and the combine of ``assignments x d_model`` fp32 values (the executor sends fp32), each priced by the
  fitted pairwise exchange ``(E - 1) x latency_s + (E - 1) / E x bytes / bytes_per_s`` on the machine
  measured (elsewhere, the catalog's links: :meth:`sim.workloads.moe.expert_parallel.ExpertSplit.exchange_s`);
  each backward the reverse dispatch and combine;
- each rank holds its layers' routed experts' parameters, gradients and optimizer state divided by E
  (exact: the profile counted each layer's routed experts' bytes).

Limits: whole stages only (T = 1, ETP = T); the activations a rank saves are priced as one process's
(a rank saves what its experts receive: equal to its own assignments only in expectation, so the
peak activation is not exact under E > 1); the exchange's own CPU work (sorting the assignments, the
gradient scaling) is not priced; no overlap of the all-to-alls with compute, as the executor runs
them; the split backward's I and W take half the backward's excess each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.catalog.hardware import Link
from sim.errors import GpipeInputError
from sim.workloads.moe.expert_parallel import ExpertSplit
from sim.workloads.moe.layers import expected_max_load
from sim.workloads.precision import FP32_BYTES

COUNT_BYTES = 8  # one int64 per expert: the counts exchanged before each dispatch


def fitted_all_to_all_s(link: Link, members: int, nbytes: float) -> float:
    """One all-to-all of ``nbytes`` per rank among ``members`` ranks on the fitted pairwise exchange
    (:mod:`calibrate.measure.ep_collectives`): ``(E - 1) x latency + (E - 1) / E x bytes / bandwidth``."""
    if members < 2:
        return 0.0
    return (members - 1) * link.latency_s + (members - 1) / members * nbytes / link.bandwidth_bytes_per_s


@dataclass(frozen=True)
class MeasuredExperts:
    """A costs file's routed experts, split over ``split.expert_parallel`` ranks: the per-layer entries
    (``layers``: index -> entry), the fitted all-to-all (``link``, None: the split's catalog links), and
    the model's routing (``experts`` n, ``top_k``, ``seq`` tokens per row, ``d_model``)."""

    split: ExpertSplit
    layers: dict[int, dict[str, Any]]
    link: Link | None
    experts: int
    top_k: int
    seq: int
    d_model: int

    @property
    def expert_parallel(self) -> int:
        return self.split.expert_parallel

    def param_bytes(self, layer: int) -> int:
        """Layer ``layer``'s routed experts' parameter bytes, every expert (0 for a layer without)."""
        entry = self.layers.get(layer)
        return int(entry["param_bytes"]) if entry else 0

    def held_bytes(self, layer: int) -> int:
        """The part of them one rank holds: n/E whole experts."""
        return self.param_bytes(layer) // self.expert_parallel

    def assignments(self, rows: int) -> int:
        """Assignments one rank routes for a micro-batch of ``rows``: rows x seq x top_k."""
        return rows * self.seq * self.top_k

    def load(self, rows: int) -> float:
        """The most loaded rank's assignments over the mean, for the group's E x rows x seq tokens."""
        return expected_max_load(self.expert_parallel * rows * self.seq, self.expert_parallel, self.top_k)

    def excess_s(self, kind: str, layer: int, rows: int, threads: int) -> float:
        """What the most loaded rank adds to layer ``layer``'s profiled ``kind`` (F, R, B; I and W half of
        B's; 0 for any other kind and a layer without routed experts) at ``threads`` (the nearest fitted)."""
        entry = self.layers.get(layer)
        if entry is None or kind not in ("F", "R", "B", "I", "W"):
            return 0.0
        fits = entry["fit"]
        nearest = min(fits, key=lambda t: (abs(int(t) - threads), int(t)))
        line = fits[nearest]["B" if kind in ("I", "W") else kind]
        share = 0.5 if kind in ("I", "W") else 1.0
        return share * (self.load(rows) - 1.0) * float(line["per_assignment_s"]) * self.assignments(rows)

    def _all_to_all_s(self, nbytes: float) -> float:
        if self.link is not None:
            return fitted_all_to_all_s(self.link, self.expert_parallel, nbytes)
        return self.split.exchange_s(nbytes)

    def exchange_s(self, layer: int, rows: int) -> tuple[float, float]:
        """(forward, backward) all-to-all seconds of layer ``layer`` for a micro-batch of ``rows``: the
        counts, dispatch and combine forward, the two reversed backward; (0, 0) without routed experts."""
        if layer not in self.layers:
            return 0.0, 0.0
        payload = self.assignments(rows) * self.d_model * FP32_BYTES
        hidden = self._all_to_all_s(payload)
        return self._all_to_all_s(self.experts * COUNT_BYTES) + 2 * hidden, 2 * hidden


def measured_experts(data: dict[str, Any], options: dict[str, Any], split: ExpertSplit,
                     measured_system: bool) -> MeasuredExperts:
    """The :class:`MeasuredExperts` of the costs record ``data`` (its model's ``options``) split as
    ``split`` says; the fitted all-to-all where ``measured_system`` and the file has one. One line where
    the file cannot price it."""
    from sim.formats.costs_links import expert_parallel_link

    entry = data.get("experts")
    if not isinstance(entry, dict) or not entry.get("layers"):
        raise GpipeInputError("--expert-parallel with --costs: the costs file has no profile of its routed experts "
                              "(a model without experts, or calibrated before they were timed apart); re-run gpipe "
                              "calibrate --force")
    if split.expert_tensor_parallel != 1:
        raise GpipeInputError("--expert-parallel with --costs prices whole experts on whole stages (T = 1, "
                              f"ETP = 1), not ETP {split.expert_tensor_parallel}; drop --tensor-parallel and "
                              "--expert-tensor-parallel")
    layers = {int(i): layer for i, layer in entry["layers"].items()}
    link = expert_parallel_link(data) if measured_system else None
    return MeasuredExperts(split, layers, link, int(options["experts"]), int(options["top_k"]), int(options["seq"]),
                           int(options["d_model"]))
