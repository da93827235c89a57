"""The GPipe paper's Table 2 (Transformer-48 on TPUv3) replayed in simulation, cell by cell.

Huang et al. 2019 ("GPipe", arXiv 1811.06965), Table 2, report training throughput of a 48-layer
Transformer for K in {2, 4, 8} stages and M in {1, 4, 32} micro-batches, normalised to K=2, M=1.
Every cell here uses one description, with nothing tuned to any cell:

- model: the built-in transformer with the paper's sizes (d_model 2048, ff 8192, 32 heads,
  sequence 1024, vocabulary 32k, 48 blocks; about 50.3M parameters per block), fp32 weights and two
  optimizer slots (RMSProp: 12 bytes per parameter, plus our fp32 gradient buffer), precision fp32
  (not the catalog's bf16 default for TPUs: the replay keeps the description it was published with);
- hardware: the catalog's ``tpu-v3`` (one TPUv3 core per stage, 16 GiB, ICI links) at the
  catalog's default efficiency, which cancels in the normalised throughput;
- training: batch 32 in every cell, re-materialization on for every micro-batch
  (``checkpoint=always``, as the paper), the GPipe fill-and-drain schedule, the memory-aware
  min-max partition (the balanced one where nothing fits).

Cells that do not fit 16 GiB are simulated anyway and flagged: at K=2 the weights, gradients and
optimizer state of 24 blocks alone exceed one core's memory (the paper says it adjusted the batch
size where memory required, which we do not: a per-cell batch would be a per-cell constant).

What the model does not capture: it predicts throughput from the bubble, the stage imbalance and
compute alone. At M=1 the only overlap it sees is a stage re-materializing while it waits for its
gradient; at M=4 it lands well under the paper, whose per-cell batch adjustments and TPU kernel
efficiency at each micro-batch size are not modelled (one efficiency serves every size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from sim.catalog.hardware import System, get_system
from sim.engine.stage_costs import CostTable
from sim.planner.search import Candidate
from sim.planner.whatif import simulate_candidate
from sim.workloads.models import get_workload
from sim.workloads.workload import Workload

# Table 2 of the paper, Transformer-48: normalised throughput by (K, M).
PAPER_TABLE2: dict[tuple[int, int], float] = {
    (2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3,
    (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
    (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3,
}
STAGES = (2, 4, 8)
MICROBATCHES = (1, 4, 32)
TRANSFORMER_48 = {"layers": 48, "d_model": 2048, "ff": 8192, "heads": 32, "seq": 1024, "vocab": 32000,
                  "dropout": 0.0, "precision": "fp32", "optimizer_slots": 2}
BATCH = 32
SYSTEM = "tpu-v3"
CHECKPOINT = "always"
NOT_CAPTURED = (
    "Not captured: the simulator predicts throughput from pipeline bubbles, stage imbalance and "
    "compute alone, with one device efficiency for every micro-batch size; the paper adjusted the "
    "batch size per cell to fit memory and its TPU kernels run at different efficiencies per "
    "micro-batch size, which is where the M=4 row's gap comes from; at M=1 the only overlap "
    "modelled is a stage re-materializing while it waits for its gradient.")


@dataclass(frozen=True)
class PaperCell:
    """One cell of Table 2: the paper's number, the simulated one and their relative gap."""

    stages: int
    microbatches: int
    paper: float
    simulated: float
    gap: float  # simulated / paper - 1
    step_time_s: float
    bubble_fraction: float
    throughput_samples_per_s: float
    peak_memory_bytes: int
    fits: bool


def transformer_48() -> Workload:
    return get_workload("transformer", dict(TRANSFORMER_48))


def replay(workload: Workload | None = None, system: System | None = None, batch_size: int = BATCH,
           checkpoint: str = CHECKPOINT) -> list[PaperCell]:
    """Simulate every cell of Table 2 with one workload and one system; rows M, columns K."""
    workload = workload or transformer_48()
    system = system or get_system(SYSTEM)
    table = CostTable(workload, system.device)
    results = {}
    for m in MICROBATCHES:
        for k in STAGES:
            candidate = Candidate(k, m, checkpoint, "gpipe")
            results[k, m] = simulate_candidate(workload, system, batch_size, candidate, table)
    base = results[STAGES[0], MICROBATCHES[0]].throughput_samples_per_s
    cells = []
    for (k, m), result in results.items():
        simulated = result.throughput_samples_per_s / base
        paper = PAPER_TABLE2[k, m]
        cells.append(PaperCell(k, m, paper, simulated, simulated / paper - 1, result.step_time_s,
                               result.bubble_fraction, result.throughput_samples_per_s,
                               max(s.peak_memory_bytes for s in result.stages), result.fits))
    return cells


def bubble_points(stage_options: Sequence[int] = STAGES,
                  microbatch_options: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  workload: Workload | None = None, system: System | None = None,
                  batch_size: int = BATCH, checkpoint: str = CHECKPOINT) -> list[tuple[int, int, float]]:
    """(K, M, simulated bubble fraction) of the replay's model, for the bubble-against-M figure."""
    workload = workload or transformer_48()
    system = system or get_system(SYSTEM)
    table = CostTable(workload, system.device)
    points = []
    for k in stage_options:
        for m in microbatch_options:
            result = simulate_candidate(workload, system, batch_size, Candidate(k, m, checkpoint, "gpipe"), table)
            points.append((k, m, result.bubble_fraction))
    return points


def format_table(cells: Sequence[PaperCell]) -> str:
    """The table as printed by ``gpipe paper``: paper / simulated (gap) per cell, then memory."""
    by_cell = {(c.stages, c.microbatches): c for c in cells}
    width = 28
    lines = [f"GPipe Table 2, Transformer-48 on {SYSTEM}, batch {BATCH}, checkpoint {CHECKPOINT}, "
             f"precision {TRANSFORMER_48['precision']}: "
             "throughput normalised to K=2, M=1 (paper / simulated, relative gap)",
             "M \\ K " + "".join(f"{f'K={k}':>{width}}" for k in STAGES)]
    for m in MICROBATCHES:
        row = "".join(f"{f'{by_cell[k, m].paper:.2f} / {by_cell[k, m].simulated:.2f} ({by_cell[k, m].gap:+.1%})':>{width}}"
                      for k in STAGES)
        lines.append(f"{f'M={m}':<6}{row}")
    lines.append("peak memory per core (GiB; * = over 16 GiB):")
    for m in MICROBATCHES:
        row = "".join(f"{f'{by_cell[k, m].peak_memory_bytes / 2**30:.1f}' + ('' if by_cell[k, m].fits else '*'):>{width}}"
                      for k in STAGES)
        lines.append(f"{f'M={m}':<6}{row}")
    lines.append(NOT_CAPTURED)
    return "\n".join(lines)


def cells_to_dicts(cells: Sequence[PaperCell]) -> list[dict]:
    return [asdict(c) for c in cells]
