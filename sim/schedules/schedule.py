"""The pipeline schedule as data: one ordered list of actions per stage.

Both the simulator and the executor walk these lists, so what is predicted is what runs. Sends and
receives are implied: a forward of micro-batch m on stage k needs stage k-1's forward output of m,
and a backward needs stage k+1's input gradient of m. A recompute needs only the stage's own stashed
input, so it may start before the gradient arrives (as the GPipe paper notes).

Timing diagram of ``gpipe`` (fill and drain), K=3, M=4, ``never``::

    stage 0: F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
    stage 1: .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
    stage 2: .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

Backward runs in reverse micro-batch order, so under ``except_last`` the last micro-batch, whose
activations are still live when backward starts, is the one not recomputed. ``1f1b`` interleaves one
forward with one backward after a warm-up of K-k-1 forwards on stage k and runs backwards in
micro-batch order; it bounds the number of micro-batches in flight per stage by K-k.

``interleaved`` (Megatron-LM's interleaved 1F1B) gives each of the K devices V chunks of layers:
chunk c of device d is virtual stage s = c*K + d, so a micro-batch visits devices 0..K-1 V times.
:func:`build_schedule` then returns one list per *device*, and each action's ``stage`` is the
virtual stage it runs. Micro-batches go in groups of K: a device runs the forwards of K
micro-batches on its chunk 0, then the same K on chunk 1, and so on; backwards mirror this from the
last chunk. After a warm-up of 2(K-d-1) + (V-1)K forwards (Megatron-LM's count), device d
alternates one forward with one backward. It needs M to be a multiple of K (a group of K
micro-batches keeps every device busy until the first of them comes back for the next chunk) and
V*K layers at least. On uniform costs and free links its bubble is (K-1)/(V*M+K-1): the idle time
of 1F1B divided by V, paid for with more activations in flight and V times the hand-offs.

``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) splits each backward in two:
I, the gradient of the stage's input, which the previous stage waits for, and W, the gradients of
its weights, which nothing waits for. Stage k runs 1F1B's order with I where 1F1B runs B, and
holds back the W of its first k micro-batches, running the W of its oldest pending micro-batch
after each later I and the rest at the end, where 1F1B's stages idle in the drain. K=3, M=4::

    stage 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3
    stage 1: F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    stage 2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

Every stage then holds at most K micro-batches from forward to W (1F1B's first stage holds K; its
last holds 1), and on uniform costs the bubble is (K-1)(F+I-W) instead of 1F1B's (K-1)(F+I+W).
On the first stage, whose input needs no gradient, I has nothing to compute and W is the whole
backward. ``--checkpoint full`` recomputes each layer inside its backward and is not split.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from sim.errors import GpipeInputError, require_positive

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
# their backwards are an I (input gradient) and a W (weight gradients), dualpipev's in part
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv", "dualpipev")
# two chunks per device in a V: device d runs virtual stages d and 2K-1-d (see device_of_virtual_stage)
V_SHAPED_SCHEDULES = ("zbv", "dualpipev")
MULTI_CHUNK_SCHEDULES = ("interleaved", *V_SHAPED_SCHEDULES)  # more than one chunk of layers per device
# What gpipe plan searches unless --schedules names others: not the split-backward ones yet, whose
# cost of splitting the backward in the executor (an autograd call per group of weights) no
# calibration measures, so a predicted gain may be a measured loss (benchmarks/README.md)
PLANNED_SCHEDULES = tuple(s for s in SCHEDULES if s not in SPLIT_BACKWARD_SCHEDULES)
# always / except_last: GPipe's re-materialization of a whole stage (an R action before its backward);
# full: every layer's input kept and each layer recomputed inside the backward, just before its own
# backward (Megatron-LM's full recompute, torch's per-block activation checkpointing): no R action;
# selective: only the attention core (QK^T, softmax, attention over V) recomputed inside the backward
# (Korthikanti et al. 2022), everything else kept: no R action either
CHECKPOINT_POLICIES = ("always", "except_last", "never", "full", "selective")
# selective_op: torchtitan's op-level selective activation checkpointing (its "selective op" policy: every
# op's output saved but every second matmul's and the elementwise ops', which the backward reruns from the
# block's input; the flash attention kernel's saved). Priced by the simulator (gpipe simulate, replay) for
# what-if and published runs; not planned, and gpipe train does not run it (one line)
PRICED_ONLY_POLICIES = ("selective_op",)


class Kind(str, enum.Enum):
    """What a stage does with one micro-batch."""

    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"
    INPUT = "I"  # the backward's input gradient alone (split-backward schedules)
    WEIGHT = "W"  # the backward's weight gradients, after the micro-batch's I


COMPUTE_KINDS = tuple(kind.value for kind in Kind)  # span kinds that are a stage's own compute


def receives_gradient(kind: Kind) -> bool:
    """Whether an action of ``kind`` needs the next stage's gradient (and sends one back)."""
    return kind is Kind.BACKWARD or kind is Kind.INPUT


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``stage`` runs ``kind`` on micro-batch ``microbatch`` (all 0-based).

    ``stage`` is the virtual stage (the chunk c*K + d of the interleaved schedule); without
    interleaving, virtual stage and device are the same."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"1F3"`` is stage 1, forward, micro-batch 3."""
        match = re.fullmatch(r"(\d+)([FRBIW])(\d+)", text.strip())
        if match is None:
            raise GpipeInputError(f"bad action {text!r}; expected e.g. '1F3' (stage, F/R/B/I/W, micro-batch)")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def check_schedule_name(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise GpipeInputError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return schedule


def check_checkpoint_policy(checkpoint: str) -> str:
    if checkpoint not in CHECKPOINT_POLICIES + PRICED_ONLY_POLICIES:
        raise GpipeInputError(
            f"unknown checkpoint policy {checkpoint!r}; choose one of "
            f"{', '.join(CHECKPOINT_POLICIES + PRICED_ONLY_POLICIES)}"
        )
    return checkpoint


def recomputes_per_layer(checkpoint: str) -> bool:
    """Whether each layer is recomputed inside its backward (``full``): the backward costs a forward
    more, and a micro-batch in flight holds every layer's input."""
    return checkpoint == "full"


def recomputes_attention_core(checkpoint: str) -> bool:
    """Whether only the attention core is recomputed, inside the backward (``selective``)."""
    return checkpoint == "selective"


def recomputes_ops(checkpoint: str) -> bool:
    """Whether every second matmul and the elementwise ops are recomputed, inside the backward
    (``selective_op``, torchtitan's op-level policy)."""
    return checkpoint == "selective_op"


def recomputes(checkpoint: str, microbatch: int, microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` is re-materialized as a whole stage (an R action before its
    backward); ``full`` recomputes layer by layer inside the backward instead (:func:`recomputes_per_layer`)."""
    if checkpoint == "always":
        return True
    if checkpoint == "except_last":
        return microbatch != microbatches - 1
    return False


def _backward_with_recompute(stage: int, microbatch: int, microbatches: int, checkpoint: str) -> list[Action]:
    actions = []
    if recomputes(checkpoint, microbatch, microbatches):
        actions.append(Action(stage, Kind.RECOMPUTE, microbatch))
    actions.append(Action(stage, Kind.BACKWARD, microbatch))
    return actions


def _stage_gpipe(stage: int, microbatches: int, checkpoint: str) -> list[Action]:
    actions = [Action(stage, Kind.FORWARD, m) for m in range(microbatches)]
    for m in reversed(range(microbatches)):
        actions += _backward_with_recompute(stage, m, microbatches, checkpoint)
    return actions


def _stage_1f1b(stage: int, stages: int, microbatches: int, checkpoint: str) -> list[Action]:
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action(stage, Kind.FORWARD, m) for m in range(warmup)]
    next_backward = 0
    for m in range(warmup, microbatches):
        actions.append(Action(stage, Kind.FORWARD, m))
        actions += _backward_with_recompute(stage, next_backward, microbatches, checkpoint)
        next_backward += 1
    for m in range(next_backward, microbatches):
        actions += _backward_with_recompute(stage, m, microbatches, checkpoint)
    return actions


def _stage_zb_h1(stage: int, stages: int, microbatches: int, checkpoint: str) -> list[Action]:
    """1F1B's list with I for B; the W of the oldest pending micro-batch after every I but the
    first ``stage``, the rest at the end (see the module docstring)."""
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action(stage, Kind.FORWARD, m) for m in range(warmup)]
    pending: list[int] = []

    def input_then_weight(m: int) -> None:
        if recomputes(checkpoint, m, microbatches):
            actions.append(Action(stage, Kind.RECOMPUTE, m))
        actions.append(Action(stage, Kind.INPUT, m))
        pending.append(m)
        if m >= stage:  # the (m+1)-th I: the first ``stage`` of them keep their W for later
            actions.append(Action(stage, Kind.WEIGHT, pending.pop(0)))

    for m in range(warmup, microbatches):
        actions.append(Action(stage, Kind.FORWARD, m))
        input_then_weight(m - warmup)
    for m in range(microbatches - warmup, microbatches):
        input_then_weight(m)
    actions += [Action(stage, Kind.WEIGHT, m) for m in pending]
    return actions


class _ChunkLists:
    """One device's list built chunk by chunk: each call adds the next micro-batch of a (virtual
    stage, kind), skipping micro-batches past M (the V schedules' counts are written for at least
    2K-1 micro-batches and cut back, so the order of the ones kept does not change), with the
    recompute a checkpoint policy asks for before each micro-batch's first backward action."""

    def __init__(self, microbatches: int, checkpoint: str) -> None:
        self.microbatches = microbatches
        self.checkpoint = checkpoint
        self.actions: list[Action] = []
        self.count: dict[tuple[int, Kind], int] = {}
        self.pending_weights: list[tuple[int, int]] = []  # (stage, micro-batch) of each I whose W is to come

    def next_microbatch(self, stage: int, kind: Kind) -> int:
        return self.count.get((stage, kind), 0)

    def add(self, stage: int, kind: Kind) -> None:
        counted = Kind.INPUT if kind is Kind.BACKWARD else kind  # a full backward counts as the micro-batch's I
        m = self.count.get((stage, counted), 0)
        self.count[(stage, counted)] = m + 1
        if kind is Kind.INPUT:
            self.pending_weights.append((stage, m))
        if m >= self.microbatches:
            return
        if kind in (Kind.BACKWARD, Kind.INPUT) and recomputes(self.checkpoint, m, self.microbatches):
            self.actions.append(Action(stage, Kind.RECOMPUTE, m))
        self.actions.append(Action(stage, kind, m))

    def add_weight(self, stage: int) -> None:
        """The W of ``stage``'s oldest micro-batch whose I has run and W has not."""
        m = next(m for s, m in self.pending_weights if s == stage)
        self.pending_weights.remove((stage, m))
        if m < self.microbatches:
            self.actions.append(Action(stage, Kind.WEIGHT, m))

    def add_oldest_weight(self) -> None:
        """The W of the oldest I on the device, whichever chunk ran it (none pending: nothing)."""
        if self.pending_weights:
            self.add_weight(self.pending_weights[0][0])


def _device_zbv(device: int, stages: int, microbatches: int, checkpoint: str) -> list[Action]:
    """ZB-V on device d (Qi et al. 2024, section 6): chunk ``down`` = d, chunk ``up`` = 2K-1-d. The
    warm-up fills the V (2(K-d)-1 forwards down, then d pairs up-down, then K-d of F, I, W up); the
    steady state runs F, I, W down then F, I, W up; the drain runs d pairs of I down, I up, then K-d
    of I, W down, and the W held back, up's before down's. Counts are written for max(M, 2K-1)
    micro-batches and cut back to M (:class:`_ChunkLists`)."""
    down, up = device, 2 * stages - 1 - device
    padded = max(microbatches, 2 * stages - 1)
    lists = _ChunkLists(microbatches, checkpoint)
    for _ in range(2 * (stages - device) - 1):
        lists.add(down, Kind.FORWARD)
    for _ in range(device):
        lists.add(up, Kind.FORWARD)
        lists.add(down, Kind.FORWARD)
    for _ in range(stages - device):
        lists.add(up, Kind.FORWARD)
        lists.add(up, Kind.INPUT)
        lists.add_weight(up)
    while (lists.next_microbatch(down, Kind.FORWARD) < padded
           or lists.next_microbatch(up, Kind.FORWARD) < lists.next_microbatch(down, Kind.FORWARD)):
        if lists.next_microbatch(down, Kind.FORWARD) < padded:
            lists.add(down, Kind.FORWARD)
        lists.add(down, Kind.INPUT)
        lists.add_weight(down)
        lists.add(up, Kind.FORWARD)
        lists.add(up, Kind.INPUT)
        lists.add_weight(up)
    for _ in range(device):
        lists.add(down, Kind.INPUT)
        lists.add(up, Kind.INPUT)
    for _ in range(stages - device):
        lists.add(down, Kind.INPUT)
        lists.add_weight(down)
    for stage in (up, down):
        while any(s == stage for s, _m in lists.pending_weights):
            lists.add_weight(stage)
    return lists.actions


def _device_dualpipev(device: int, stages: int, microbatches: int, checkpoint: str) -> list[Action]:
    """DualPipeV on device d (DeepSeek-V3's DualPipe folded into a V, as torch's ScheduleDualPipeV
    runs it): chunk ``down`` = d, chunk ``up`` = 2K-1-d. Warm-up: 2(K-d-1) forwards down, d+1 pairs
    down-up, K-d-1 of I up, the oldest W, F up. Steady: F down, B up, F up, B down, where DeepSeek
    overlaps each forward with the other chunk's backward; here they run one after the other (eager
    PyTorch has no overlap of compute with compute), so the pairing only orders them. Drain: K-d-1 of
    B up, F up, B down; d+1 backward pairs up-down, split into I from the middle one on; K-d-1 of
    the oldest W then I down; the W still held. Needs M >= 2K (:func:`check_v_schedule`)."""
    down, up = device, 2 * stages - 1 - device
    lists = _ChunkLists(microbatches, checkpoint)
    for _ in range(2 * (stages - device - 1)):
        lists.add(down, Kind.FORWARD)
    for _ in range(device + 1):
        lists.add(down, Kind.FORWARD)
        lists.add(up, Kind.FORWARD)
    for _ in range(stages - device - 1):
        lists.add(up, Kind.INPUT)
        lists.add_oldest_weight()
        lists.add(up, Kind.FORWARD)
    for _ in range(microbatches - 2 * stages + device + 1):
        lists.add(down, Kind.FORWARD)
        lists.add(up, Kind.BACKWARD)
        lists.add(up, Kind.FORWARD)
        lists.add(down, Kind.BACKWARD)
    for _ in range(stages - device - 1):
        lists.add(up, Kind.BACKWARD)
        lists.add(up, Kind.FORWARD)
        lists.add(down, Kind.BACKWARD)
    middle = (device + 1) // 2  # from here on the backwards are split, up's one pair later on even devices
    for i in range(device + 1):
        lists.add(up, Kind.INPUT if i > middle or (i == middle and device % 2) else Kind.BACKWARD)
        lists.add(down, Kind.INPUT if i >= middle else Kind.BACKWARD)
    for _ in range(stages - device - 1):
        lists.add_oldest_weight()
        lists.add(down, Kind.INPUT)
    while lists.pending_weights:
        lists.add_oldest_weight()
    return lists.actions


def check_v_schedule(schedule: str, stages: int, microbatches: int) -> None:
    """DualPipeV's steady state needs at least 2K micro-batches (its warm-up alone starts 2K-1)."""
    if schedule == "dualpipev" and microbatches < 2 * stages:
        raise GpipeInputError(f"--schedule dualpipev needs at least 2K = {2 * stages} micro-batches with K={stages} "
                              f"stages, got M={microbatches}; use --microbatches {2 * stages} or more")


def check_split_backward(schedule: str, checkpoint: str) -> None:
    """A split-backward schedule with a checkpoint policy whose backward cannot be split, refused."""
    if schedule in SPLIT_BACKWARD_SCHEDULES and recomputes_per_layer(checkpoint):
        raise GpipeInputError(f"--schedule {schedule} splits each backward into input and weight gradients, which "
                              "--checkpoint full (each layer recomputed inside its backward) does not; use "
                              "--checkpoint never, selective, except_last or always")


def _interleaved_microbatch(index: int, stages: int, virtual_stages: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a device's ``index``-th forward (or backward): groups of K
    micro-batches sweep the chunks, first to last for forwards and last to first for backwards."""
    group, within = divmod(index, stages * virtual_stages)
    chunk = within // stages
    if not forward:
        chunk = virtual_stages - 1 - chunk
    return chunk, group * stages + within % stages


def _device_interleaved(device: int, stages: int, microbatches: int, virtual_stages: int,
                        checkpoint: str) -> list[Action]:
    total = microbatches * virtual_stages

    def forward(i: int) -> Action:
        chunk, m = _interleaved_microbatch(i, stages, virtual_stages, True)
        return Action(chunk * stages + device, Kind.FORWARD, m)

    def backward(i: int) -> list[Action]:
        chunk, m = _interleaved_microbatch(i, stages, virtual_stages, False)
        return _backward_with_recompute(chunk * stages + device, m, microbatches, checkpoint)

    warmup = min(2 * (stages - device - 1) + (virtual_stages - 1) * stages, total)
    actions = [forward(i) for i in range(warmup)]
    next_backward = 0
    for i in range(warmup, total):
        actions.append(forward(i))
        actions += backward(next_backward)
        next_backward += 1
    for i in range(next_backward, total):
        actions += backward(i)
    return actions


def check_interleaving(stages: int, microbatches: int, virtual_stages: int, num_layers: int | None = None) -> None:
    """The interleaved schedule's requirements, each refused in one line."""
    require_positive("virtual stages (V)", virtual_stages, "use --virtual-stages 2 or more")
    if microbatches % stages:
        raise GpipeInputError(f"the interleaved schedule needs micro-batches (M={microbatches}) to be a multiple "
                              f"of stages (K={stages}); use --microbatches {stages * max(1, -(-microbatches // stages))}")
    if num_layers is not None and virtual_stages * stages > num_layers:
        raise GpipeInputError(f"{virtual_stages} virtual stages x {stages} stages = {virtual_stages * stages} "
                              f"chunks but the model has {num_layers} layers; use fewer --virtual-stages or --stages")


def check_virtual_stages(schedule: str, virtual_stages: int) -> None:
    """--virtual-stages belongs to the multi-chunk schedules: 2 or more interleaved, exactly 2 in a V."""
    if schedule in V_SHAPED_SCHEDULES:
        if virtual_stages != 2:
            raise GpipeInputError(f"--schedule {schedule} runs two chunks per device in a V; use --virtual-stages 2, "
                                  f"not {virtual_stages}")
        return
    if schedule != "interleaved" and virtual_stages != 1:
        raise GpipeInputError(f"--virtual-stages {virtual_stages} needs --schedule interleaved, zbv or dualpipev "
                              f"(the {schedule} schedule runs one chunk per device)")
    if schedule == "interleaved" and virtual_stages < 2:
        raise GpipeInputError(f"--schedule interleaved needs --virtual-stages 2 or more, got {virtual_stages}")


def default_virtual_stages(schedule: str) -> int:
    """V when none is given: 2 for the multi-chunk schedules, 1 otherwise."""
    return 2 if schedule in MULTI_CHUNK_SCHEDULES else 1


def build_schedule(stages: int, microbatches: int, schedule: str = "gpipe",
                   checkpoint: str = "except_last", virtual_stages: int = 1) -> list[list[Action]]:
    """Each device's ordered actions for one mini-batch: ``result[k]`` is device k's list.

    ``stages`` is K, the devices of one pipeline; with ``interleaved`` each device runs
    ``virtual_stages`` chunks and the actions name virtual stages (see the module docstring)."""
    require_positive("stages (K)", stages, "use --stages 1 or more")
    require_positive("micro-batches (M)", microbatches, "use --microbatches 1 or more")
    check_schedule_name(schedule)
    check_checkpoint_policy(checkpoint)
    check_virtual_stages(schedule, virtual_stages)
    check_split_backward(schedule, checkpoint)
    if schedule == "interleaved":
        check_interleaving(stages, microbatches, virtual_stages)
    check_v_schedule(schedule, stages, microbatches)
    return [stage_actions(k, stages, microbatches, schedule, checkpoint, virtual_stages) for k in range(stages)]


def stage_actions(stage: int, stages: int, microbatches: int, schedule: str = "gpipe",
                  checkpoint: str = "except_last", virtual_stages: int = 1) -> list[Action]:
    """Device ``stage``'s list of :func:`build_schedule`, without building the others' (unchecked)."""
    if schedule == "gpipe":
        return _stage_gpipe(stage, microbatches, checkpoint)
    if schedule == "interleaved":
        return _device_interleaved(stage, stages, microbatches, virtual_stages, checkpoint)
    if schedule == "zb-h1":
        return _stage_zb_h1(stage, stages, microbatches, checkpoint)
    if schedule == "zbv":
        return _device_zbv(stage, stages, microbatches, checkpoint)
    if schedule == "dualpipev":
        return _device_dualpipev(stage, stages, microbatches, checkpoint)
    return _stage_1f1b(stage, stages, microbatches, checkpoint)


def cold_starts(actions: Sequence[Action]) -> list[bool]:
    """Which of a device's actions start cold: the first of its list, the step's first action,
    after the optimizer and the executor's work between steps have displaced its weights' and
    activations' cache lines and the code it runs. Within one run the step's first forward took
    longer than the forwards after it on stages of one and three layers, while an action
    after another kind of action was not measurably slower on three layers
    (docs/notes/2026-11-26-cold-starts.md, ``benchmarks/cold_starts.py``). The simulator adds the
    stage's ``cold_start_s`` for it and calibration fits that time on the same marks."""
    return [i == 0 for i in range(len(actions))]


def device_of_virtual_stage(virtual_stage: int, stages: int, schedule: str = "interleaved") -> int:
    """The device (pipeline position) that runs virtual stage ``virtual_stage``, chunk ``s // K``.

    Loop placement (interleaved, and one chunk per device): s mod K, so every chunk goes down the
    devices and the hop from device K-1 to device 0 joins two chunks. V placement (zbv, dualpipev):
    chunk 0 goes down (device s) and chunk 1 comes back up (device 2K-1-s), so the hand-off between
    the chunks stays on device K-1 and device 0 holds both the first and the last stage."""
    chunk, within = divmod(virtual_stage, stages)
    if schedule in V_SHAPED_SCHEDULES and chunk % 2:
        return stages - 1 - within
    return within


def virtual_stages_of_device(device: int, stages: int, virtual_stages: int, schedule: str = "interleaved") -> list[int]:
    """The virtual stages device ``device`` runs, chunk 0 first (inverse of :func:`device_of_virtual_stage`)."""
    return [c * stages + (stages - 1 - device if schedule in V_SHAPED_SCHEDULES and c % 2 else device)
            for c in range(virtual_stages)]


def walk_in_rounds(per_device: Sequence[Sequence[Action]], run: Callable[[int, Action], bool]) -> list[int]:
    """Walk every device's list in order, round after round, each as far as ``run(device, action)``
    lets it (False: that action's input is not there yet, so the device waits); stop when a round
    runs nothing. Returns how far each device got: short of a list's end means the lists deadlock."""
    position = [0] * len(per_device)
    progressed = True
    while progressed:
        progressed = False
        for device, actions in enumerate(per_device):
            while position[device] < len(actions) and run(device, actions[position[device]]):
                position[device] += 1
                progressed = True
    return position


def format_grid(per_stage: list[list[Action]], highlight: Action | None = None) -> str:
    """One line per stage, actions in order, for error messages and debugging.

    ``highlight`` is wrapped in brackets, e.g. the action a failing rank was running.
    """
    lines = []
    for k, actions in enumerate(per_stage):
        cells = [f"[{a}]" if a == highlight else str(a) for a in actions]
        lines.append(f"stage {k}: " + " ".join(cells))
    return "\n".join(lines)
