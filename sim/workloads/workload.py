"""What the simulator needs to know about a model: per-layer costs at a given micro-batch size.

A :class:`Workload` answers ``layer_costs(rows, device)``: one :class:`LayerCost` per layer for a
micro-batch of ``rows`` samples on ``device``. The analytic models (:mod:`sim.workloads.models`) derive these
from FLOPs and bytes against the device's roofline; calibration supplies measured costs through the
same interface, so the engine never knows which it is running.

Memory terms follow the GPipe paper: a stage keeps its boundary input per micro-batch (the stash);
activations saved for backward are held from a micro-batch's forward (or its recompute) until its
backward. Parameters, gradients and optimizer state are held throughout the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, Sequence

from sim.catalog.hardware import Device, Link, System
from sim.errors import GpipeInputError
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for one micro-batch of a given size on one device."""

    name: str
    forward_s: float
    backward_s: float
    recompute_s: float  # a forward run again before backward; usually equal to forward_s
    saved_bytes: int  # tensors autograd keeps for this layer's backward (its input included)
    output_bytes: int  # the layer's output: what crosses to the next stage at a boundary
    param_bytes: int  # weights
    grad_bytes: int  # weight gradients, held for the whole step
    optimizer_bytes: int  # optimizer state (e.g. two slots for Adam or RMSProp)
    input_bytes: int = 0  # the layer's input: what a stage starting here stashes per micro-batch
    optimizer_s: float = 0.0  # this layer's share of the once-per-step optimizer update
    # whether saved_bytes holds the input's own storage; when not (a bf16 cast of it is saved
    # instead, or nothing), a stage starting here holds its stashed input besides saved_bytes
    saves_input: bool = True
    # --checkpoint selective: what the attention core saves (dropped and recomputed inside the backward)
    # and the time to recompute it; 0 for a layer without attention
    core_saved_bytes: int = 0
    core_recompute_s: float = 0.0
    # --checkpoint selective_op (torchtitan's op-level policy): what the block does not keep (saved_bytes less
    # what the policy saves) and the time to rerun what it dropped inside the backward; 0 for a layer not
    # checkpointed
    op_dropped_bytes: int = 0
    op_recompute_s: float = 0.0
    # expert parallelism (sim.workloads.moe.expert_parallel): the all-to-alls' exposed seconds counted in
    # forward_s (and recompute_s) and backward_s, and the routed experts' gradient bytes, reduced over the
    # expert-data-parallel group rather than all D replicas
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0
    expert_grad_bytes: int = 0


@dataclass(frozen=True)
class SharedParameter:
    """One parameter that several layers use (a tied embedding and output head).

    Each layer's :class:`LayerCost` counts it, as each layer holds it. A stage holding several of
    ``layers`` keeps one copy; stages on different devices each keep one, and after the step's last
    backward they sum their gradients (an all-reduce among the owners) before the optimizer step.
    """

    name: str
    layers: tuple[int, ...]  # the layers using it, ascending
    param_bytes: int  # its weights
    static_bytes: int  # weights, gradient and optimizer state: what a stage saves by not holding a copy


def check_checkpoint_for(workload: "Workload", checkpoint: str) -> str:
    """``selective`` recomputes an attention core, which the built-in transformer's analytic model
    and a costs file that profiled one know of (``has_attention_core``); ``selective_op`` needs blocks that
    price it (``checkpoints_ops``); refused in one line elsewhere."""
    if checkpoint == "selective" and not workload.has_attention_core:
        name = workload.name
        raise GpipeInputError(f"--checkpoint selective recomputes the attention core, which {name} has none of "
                              "(the built-in transformer has one; a costs file must profile it: gpipe calibrate "
                              "--force); use full")
    if checkpoint == "selective_op" and not workload.checkpoints_ops:
        raise GpipeInputError(f"--checkpoint selective_op (torchtitan's op-level policy) is priced for a dense "
                              f"transformer with attention=flash on the analytic model, not {workload.name}; "
                              "use selective or full")
    return checkpoint


def shared_parameters(workload: "Workload") -> tuple[SharedParameter, ...]:
    """The workload's shared parameters, as a tuple."""
    return tuple(workload.shared_parameters)


class WorkloadCapabilities:
    """What a workload may offer beyond its layer costs, each answered here as a workload without it
    answers, so every workload answers every question and no caller probes for a member.

    A workload class inherits this and overrides what it has: measured costs (a costs file's
    :class:`sim.formats.measured_workload.MeasuredWorkload`: ``measured_costs``, ``bind``,
    ``allreduce_link``, ``stage_cost``), an attention core ``--checkpoint selective`` recomputes,
    parameters several layers share, the Hugging Face model it was planned from.
    """

    has_attention_core: bool = False  # a core --checkpoint selective drops and recomputes
    checkpoints_ops: bool = False  # blocks --checkpoint selective_op prices (torchtitan's op-level policy)
    shared_parameters: tuple[SharedParameter, ...] = ()  # parameters several layers use (SharedParameter)
    planned_from: str | None = None  # the Hugging Face model it prices by its shape, if any
    has_experts: bool = False  # a mixture of experts, whose routed experts expert parallelism splits
    expert_parallel: int = 1  # E its experts are split over (sim.workloads.moe.expert_parallel)
    measured_costs: bool = False  # priced from a costs file: bound to a K before simulating
    experts_profiled: bool = False  # measured costs that timed the routed experts apart (expert parallelism)
    # measured per-stage costs (rows, first, end, device) -> StageCost, in place of summing layers; None: sum them
    stage_cost: Any = None
    options: Mapping[str, Any] = MappingProxyType({})  # the model's options as given (attention, compile, ...)
    tensor_parallel: int = 1  # T each layer is split over (sim.workloads.tensor_parallel)
    sequence_parallel: bool = False  # with T > 1: norms and dropout split along the sequence
    context_parallel: int = 1  # C each sequence is split over
    tp_link: Link | None = None  # the link T's collectives cross; None: the system's own
    experts_split: Any = None  # with E > 1 (or an ETP of its own): the ExpertSplit (sim.workloads.moe.expert_parallel)
    assumed: Sequence[str] | None = None  # what pricing it by its structure leaves out (a Hugging Face model)
    optimizer: str | None = None  # the optimizer its costs were measured with; None: the plan's to choose
    batch_size: int | None = None  # the batch its costs were measured at; None: the model's default
    experts: Any = None  # a costs file's routed experts split by E (sim.formats.measured_experts); None elsewhere

    def bind(self, system: System, stages: int, checkpoint: str = "except_last", microbatches: int | None = None,
             replicas: int = 1) -> tuple[Any, System]:
        """This workload for K=``stages`` in D=``replicas`` pipelines on ``system``: itself, unless its
        costs were measured per K."""
        return self, system

    def allreduce_link(self, system: System) -> Link | None:
        """A measured all-reduce link on ``system``; None: the catalog's links price it."""
        return None

    def sharded_links(self, system: System) -> tuple[Link | None, Link | None, Link | None]:
        """Fitted (all-gather, reduce-scatter, all-reduce) links on ``system`` for ZeRO-2/3
        (:mod:`sim.engine.fsdp`); None each: the catalog's links price them."""
        return None, None, None


class Workload(Protocol):
    """A model as the simulator sees it: its layer costs, and the capabilities of
    :class:`WorkloadCapabilities` (which a workload class inherits, overriding what it has)."""

    name: str
    num_layers: int
    has_attention_core: bool
    checkpoints_ops: bool
    shared_parameters: tuple[SharedParameter, ...]
    planned_from: str | None
    has_experts: bool
    expert_parallel: int
    measured_costs: bool
    stage_cost: Any
    options: Mapping[str, Any]
    tensor_parallel: int
    sequence_parallel: bool
    context_parallel: int
    tp_link: Link | None
    experts_split: Any
    assumed: Sequence[str] | None
    optimizer: str | None
    batch_size: int | None
    experts: Any

    def bind(self, system: System, stages: int, checkpoint: str = "except_last", microbatches: int | None = None,
             replicas: int = 1) -> tuple[Any, System]:
        """This workload bound to K stages on ``system`` (see :class:`WorkloadCapabilities`)."""
        ...

    def allreduce_link(self, system: System) -> Link | None:
        """A measured all-reduce link on ``system``, or None."""
        ...

    def sharded_links(self, system: System) -> tuple[Link | None, Link | None, Link | None]:
        """Fitted (all-gather, reduce-scatter, all-reduce) links on ``system``, or None each."""
        ...

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        """Costs of every layer, in order, for a micro-batch of ``rows`` samples on ``device``."""
        ...

    def describe(self) -> dict:
        """Name, options and parameter count, for the plan file and reports."""
        ...


@dataclass(frozen=True)
class UniformWorkload(WorkloadCapabilities):
    """The textbook case: L identical layers, fixed forward and backward time whatever the device.

    Times are per micro-batch and do not depend on its size, so with free links the bubble is
    exactly (K-1)/(M+K-1). Memory terms are nominal (1 MiB of activation per layer and micro-batch).
    """

    num_layers: int
    forward_s: float = 1e-3
    backward_s: float = 2e-3
    activation_bytes: int = 1 << 20
    param_bytes: int = 4 << 20
    optimizer_slots: int = OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]  # state tensors per parameter
    name: str = "uniform"

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        layer = LayerCost(
            name="layer", forward_s=self.forward_s, backward_s=self.backward_s,
            recompute_s=self.forward_s, saved_bytes=self.activation_bytes,
            output_bytes=self.activation_bytes, input_bytes=self.activation_bytes,
            param_bytes=self.param_bytes, grad_bytes=self.param_bytes,
            optimizer_bytes=self.optimizer_slots * self.param_bytes,
        )
        return [layer] * self.num_layers

    def describe(self) -> dict:
        return {"name": self.name, "options": {"layers": self.num_layers, "optimizer_slots": self.optimizer_slots},
                "num_layers": self.num_layers,
                "parameter_count": self.num_layers * self.param_bytes // 4}
