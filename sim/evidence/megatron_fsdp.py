"""Runs that state Megatron-FSDP: when such a run reduce-scatters its sharded gradients.

A runs file's ``use_megatron_fsdp`` (true, false or null; the name of Megatron-Bridge's setting and
Megatron-LM's ``--use-megatron-fsdp``) says the run sharded its data-parallel state with
Megatron-Core's own FSDP (``megatron/core/distributed/fsdp/``, formerly ``custom_fsdp/``) rather
than torch's FSDP2 or DeepSpeed. Its ``data_parallel_sharding_strategy`` maps onto ``zero``:
``no_shard`` 0, ``optim`` 1, ``optim_grads`` 2, ``optim_grads_params`` 3 (its default).

What differs from the replay's default: a null ``gradient_sync`` is otherwise the FSDP2/torch
default (:func:`sim.formats.layout.default_gradient_sync`: after every micro-batch with one stage,
once per step under a pipeline). Megatron-FSDP reduce-scatters a unit's gradients after every
backward whenever gradients are sharded, under a pipeline too. In Megatron-LM's
``megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py`` (and ``custom_fsdp/
fully_sharded_data_parallel.py`` before it):

* ``MegatronFSDP.__init__`` delays the gradient reduction (``is_delay_grad_reduce``) only for
  ``no_shard`` and ``optim``, and asserts ``overlap_grad_reduce`` otherwise ("Gradient
  reduce-scatter must be overlapped when using sharding optimizer and gradients");
* the post-backward hook of each FSDP unit (``_register_fsdp_hooks._post_backward``) copies the
  unit's gradients into a temporary bucket of ``main_grad`` and reduce-scatters it, on a side stream
  (``GradReducePipeline.reduce_gradients``), when ``grad_reduce_every_bprop`` (strategy
  ``optim_grads`` or ``optim_grads_params``) *or* it is the last micro-batch: with sharded
  gradients every micro-batch's backward reduces, whatever ``is_last_microbatch`` says;
* ``MegatronFSDP.no_sync``, the context Megatron-Core's pipeline schedules hold the earlier
  micro-batches in, says so: "For grads shard mode there will actually always be gradient sync
  happening";
* Transformer Engine's gradient accumulation fusion writes a unit's weight gradients into that
  temporary bucket (``param.overwrite_main_grad = True``: overwritten, not accumulated), so the
  micro-batches' gradients add up in the sharded buffer only, and no unsharded gradient outlasts a
  backward.

That is this vocabulary's ``microbatch`` at any K, which such a run with a null ``gradient_sync``
takes, said in its ``assumed``. A stated ``step`` with Megatron-FSDP is refused in one line.

Limits: only when the reduction happens is taken from Megatron-FSDP. Its reduce-scatter is priced as
FSDP2's (per unit, beside the backward of the units before it), in the gradients' dtype; its own
bucketing (``suggested_communication_unit_size``), double buffers and user buffers (``nccl_ub``)
are not modelled; nor is its release of a unit's parameters after the forward under a pipeline
(the simulator takes torchtitan's policy there, no reshard after forward).
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError
from sim.formats.layout import check_gradient_sync

# When Megatron-FSDP reduce-scatters sharded gradients (ZeRO-2/3): after every backward, at any K.
MEGATRON_FSDP_GRADIENT_SYNC = "microbatch"


def states_megatron_fsdp(run: dict[str, Any]) -> bool:
    """Whether ``run`` says its trainer sharded with Megatron-FSDP (``use_megatron_fsdp`` true);
    left out or null: not said. One line for a value neither true, false nor null."""
    value = run.get("use_megatron_fsdp")
    if value is not None and not isinstance(value, bool):
        raise GpipeInputError(f"use_megatron_fsdp {value!r}; give true, false, or null where the source does not say")
    return bool(value)


def gradient_sync_of(run: dict[str, Any], zero: int | None) -> str | None:
    """The gradient sync ``run`` is replayed with under ZeRO-2/3: as stated; null under Megatron-FSDP
    what it runs (:data:`MEGATRON_FSDP_GRADIENT_SYNC`); else None, the FSDP2/torch default
    (:attr:`sim.formats.layout.ParallelLayout.resolved_gradient_sync`). ``zero`` is the stated stage
    (None: searched). One line for a stated value the layout refuses, or ``step`` with Megatron-FSDP."""
    sync = run.get("gradient_sync")
    megatron = states_megatron_fsdp(run)
    if sync is None:
        return MEGATRON_FSDP_GRADIENT_SYNC if megatron else None
    check_gradient_sync(sync, zero if zero is not None else 2)
    if megatron and sync != MEGATRON_FSDP_GRADIENT_SYNC:
        raise GpipeInputError(f"gradient_sync {sync} with use_megatron_fsdp: Megatron-FSDP reduce-scatters sharded "
                              f"gradients after every backward; give {MEGATRON_FSDP_GRADIENT_SYNC} or null")
    return sync


def sync_lines(run: dict[str, Any], zero: int) -> list[str]:
    """The ``assumed`` line of a Megatron-FSDP run whose null ``gradient_sync`` took Megatron-FSDP's,
    replayed at ``zero`` 2 or 3; none otherwise."""
    if run.get("gradient_sync") is not None or zero < 2 or not states_megatron_fsdp(run):
        return []
    return [f"gradient_sync null: {MEGATRON_FSDP_GRADIENT_SYNC}, as Megatron-FSDP runs it: with gradients sharded "
            "(optim_grads, optim_grads_params) each unit's are reduce-scattered after every micro-batch's backward, "
            "under a pipeline too (Megatron-Core MegatronFSDP's post-backward hook, grad_reduce_every_bprop)"]
