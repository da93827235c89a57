"""Days and dollars: what a plan's step time means for a whole training run.

From a plan's predicted step (``step_s`` for ``tokens_per_step`` tokens on ``devices`` devices):

    tokens/s      = tokens_per_step / step_s
    MFU           = tokens/s x model FLOPs per token / (devices x peak FLOP/s)
    days          = train_tokens / tokens/s / 86,400
    device-hours  = days x 24 x devices
    cost          = device-hours x price per device-hour

Model FLOPs per token are PaLM's (Chowdhery et al. 2022, Appendix B): 6N + 12 L d s for N the
parameters that take part in matrix multiplies (all but the input embedding and the position table),
L layers of width d and s tokens of context; a forward and a backward, no re-materialisation
(which is why it is the *model* FLOPs utilisation). The peak is the device's dense peak at the
precision the matrix multiplies run at (fp8's for ``--precision fp8``, bf16's for the bf16 ones).

Limits: the step is the simulator's prediction, so every limit of the model carries over; no
failures, restarts, evaluation or checkpointing time; prices are on-demand list prices of the date
the catalog names (``sim.catalog.hardware``), not what a reserved or negotiated contract costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from sim.errors import GpipeInputError

if TYPE_CHECKING:
    from sim.catalog.hardware import System
    from sim.planner.search import Candidate, PlanOption
    from sim.workloads.workload import Workload

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class TrainingCost:
    devices: int
    tokens_per_s: float
    mfu: float  # model FLOPs utilisation against the dense peak of the matmuls' precision
    train_tokens: float | None = None
    days: float | None = None
    device_hours: float | None = None
    price_per_device_hour: float | None = None
    cost: float | None = None  # in the price's currency (US dollars for the catalog's prices)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_flops_per_token(options: dict[str, Any], parameter_count: int) -> float:
    """PaLM's model FLOPs per token of the built-in transformer's ``options`` (a named or Hugging
    Face model planned by its shape included): 6N + 12 L d s, N without the input embedding."""
    d, seq, layers, vocab = (int(options[k]) for k in ("d_model", "seq", "layers", "vocab"))
    matmul_parameters = parameter_count - vocab * d - seq * d  # the token table and the position table
    return 6.0 * matmul_parameters + 12.0 * layers * d * seq


def training_cost(step_s: float, tokens_per_step: float, devices: int, flops_per_token: float,
                  peak_flops_per_device: float, train_tokens: float | None = None,
                  price_per_device_hour: float | None = None) -> TrainingCost:
    """The arithmetic of the module docstring for one plan."""
    if step_s <= 0 or tokens_per_step <= 0 or devices <= 0:
        raise ValueError(f"step_s, tokens_per_step and devices must be positive: {step_s}, {tokens_per_step}, "
                         f"{devices}")
    tokens_per_s = tokens_per_step / step_s
    mfu = tokens_per_s * flops_per_token / (devices * peak_flops_per_device)
    if train_tokens is None:
        return TrainingCost(devices, tokens_per_s, mfu, price_per_device_hour=price_per_device_hour)
    days = train_tokens / tokens_per_s / SECONDS_PER_DAY
    device_hours = days * 24.0 * devices
    cost = device_hours * price_per_device_hour if price_per_device_hour is not None else None
    return TrainingCost(devices, tokens_per_s, mfu, train_tokens, days, device_hours, price_per_device_hour, cost)


def parse_token_count(text: str) -> float:
    """``15T``, ``300B``, ``2e12`` or ``1500000``: a positive number of tokens; one line otherwise."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    value = str(text).strip()
    scale = units.get(value[-1:].upper(), 1.0) if value else 1.0
    number = value[:-1] if scale != 1.0 else value
    try:
        tokens = float(number) * scale
    except ValueError:
        tokens = -1.0
    if not tokens > 0 or tokens == float("inf"):
        raise GpipeInputError(f"--train-tokens {text!r} is not a positive number of tokens; give e.g. 15T, 300B or "
                              "2e12")
    return tokens


def format_token_count(tokens: float) -> str:
    """The short form people write: 15T, 300B, 1.5M (three significant digits)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{suffix}"
    return f"{tokens:.3g}"


def dollars(amount: float) -> str:
    return f"${amount:,.0f}" if amount >= 100 else f"${amount:.3g}"


@dataclass(frozen=True)
class Costing:
    """What the planner is asked about days and dollars: the tokens to train on, what to rank by, a
    price in place of the catalog's, and the limits (devices, dollars, days)."""

    train_tokens: float | None = None
    rank_by: str = "time"  # or "cost": step time x devices x price
    price_override: float | None = None  # per device-hour, in place of the catalog's list price
    max_devices: int | None = None  # D x K x T x C at most
    max_cost: float | None = None
    several_systems: bool = False  # several hardware kinds ranked together: each plan priced
    max_days: float | None = None

    @property
    def active(self) -> bool:
        return (self.train_tokens is not None or self.rank_by == "cost" or self.several_systems
                or self.max_devices is not None)

    @property
    def limited(self) -> bool:
        """Whether the search drops plans by days or dollars."""
        return self.max_cost is not None or self.max_days is not None

    def step_limit(self, tokens_per_step: float, devices_per_group: int,
                   price: float | None) -> Callable[["Candidate"], float] | None:
        """Each candidate's longest step within --max-days and --max-cost (None: no limit): steps to
        train = tokens / tokens per step; days = steps x step / 86,400; cost = days x 24 x devices x price."""
        if not self.limited:
            return None
        assert self.train_tokens is not None
        steps = self.train_tokens / tokens_per_step
        by_days = self.max_days * SECONDS_PER_DAY / steps if self.max_days is not None else float("inf")

        def limit(c: "Candidate") -> float:
            if self.max_cost is None:
                return by_days
            devices = c.stages * c.replicas * devices_per_group
            return min(by_days, self.max_cost * 3600.0 / (steps * devices * price))  # type: ignore[operator]

        return limit


def price_of(system: "System", costing: Costing) -> float | None:
    return costing.price_override if costing.price_override is not None else system.price_per_device_hour


def price_source(system: "System", costing: Costing) -> str:
    if costing.price_override is not None:
        return "--price-per-device-hour"
    return system.price_source or "no list price in the catalog"


def plan_cost(option: "PlanOption", workload: "Workload", system: "System", batch: int, precision: str,
              costing: Costing) -> TrainingCost:
    """The :class:`TrainingCost` of a ranked plan: its step over ``batch`` sequences on its devices."""
    from sim.workloads.precision import precision_of

    c = option.candidate
    described = workload.describe()
    o = described.get("shape") or described["options"]  # a Hugging Face model's: the transformer's that prices it
    if "seq" not in o or "d_model" not in o:
        raise GpipeInputError(f"days and dollars count tokens: the model {described['name']} has no sequences; plan "
                              "the transformer, a named model (gpipe plan --list-models) or an hf: model")
    devices = c.stages * c.replicas * c.tensor_parallel * c.context_parallel
    peak = system.device.peak_flops[precision_of(precision).matmul_peak]
    # a mixture of experts counts its active parameters (sim.workloads.moe.workload)
    flops = described.get("model_flops_per_token") or model_flops_per_token(o, described["parameter_count"])
    return training_cost(option.step_time_s, batch * o["seq"], devices, flops, peak, costing.train_tokens,
                         price_of(system, costing))
