"""What a stage does off the pipeline's critical path: receives posted at its first wait, the next
step's data drawn while it waits, and a host allocator that keeps freed blocks for the next step."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.data import batch_for_step
from executor.runtime.pipeline import LocalPipeline
from executor.runtime.prefetch import StepBatches
from executor.transport.p2p import ACT

CONFIG = dict(model="mlp", options={"layers": 4, "width": 16}, partition=[2, 2], batch_size=8, microbatches=4,
              schedule="gpipe", checkpoint="never", steps=3)


class LateTransport:
    """A stage's in-process transport whose every message arrives late: ``ready`` is False the first
    ``late_asks`` times it is asked about a message. Logs what the stage posts and receives."""

    def __init__(self, inner, log, late_asks=3):
        self.inner, self.log, self.asked, self.late_asks = inner, log, {}, late_asks

    def expect(self, channel, microbatch, shapes):
        self.log.append(("post", channel, microbatch))

    def ready(self, channel, microbatch):
        asked = self.asked[(channel, microbatch)] = self.asked.get((channel, microbatch), 0) + 1
        return asked > self.late_asks and self.inner.ready(channel, microbatch)

    def recv(self, channel, microbatch):
        self.log.append(("recv", channel, microbatch))
        return self.inner.recv(channel, microbatch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class IdleLog:
    """Idle-time work that logs when it is offered a wait."""

    def __init__(self, log):
        self.log = log

    def prefetch(self, wait):
        self.log.append(("idle",))

    def waited(self, wait, seconds):
        pass


def test_receives_are_posted_in_order_the_first_at_the_start_the_rest_at_the_first_wait():
    pipe = LocalPipeline(RunConfig.of(**CONFIG))
    first, last = pipe.stages
    inputs, targets = pipe.batch(0)
    first.begin_step(0, inputs, targets)
    for action in first.actions[:4]:  # its forwards fill the last stage's mailboxes
        first.run(action)
    log = []
    last.transport = LateTransport(last.transport, log)
    last.while_waiting = IdleLog(log)
    last.begin_step(0, inputs, targets)
    assert log == [("post", ACT, 0)]  # the first receive only: the stage waits for it next
    last.run(last.actions[0])
    assert log[1:] == [("post", ACT, 1), ("post", ACT, 2), ("post", ACT, 3), ("idle",), ("recv", ACT, 0)]
    for action in last.actions[1:]:
        last.run(action)
    assert [entry for entry in log if entry[0] == "post"] == [("post", ACT, m) for m in range(4)]
    assert [entry for entry in log if entry[0] == "recv"] == [("recv", ACT, m) for m in range(4)]


def test_a_message_that_arrives_during_a_chore_is_taken_before_the_next_chore():
    pipe = LocalPipeline(RunConfig.of(**CONFIG))
    first, last = pipe.stages
    inputs, targets = pipe.batch(0)
    first.begin_step(0, inputs, targets)
    for action in first.actions[:4]:
        first.run(action)
    log = []
    last.transport = LateTransport(last.transport, log, late_asks=1)  # there once the receives are posted
    last.while_waiting = IdleLog(log)
    last.begin_step(0, inputs, targets)
    last.run(last.actions[0])
    assert log == [("post", ACT, 0), ("post", ACT, 1), ("post", ACT, 2), ("post", ACT, 3), ("recv", ACT, 0)]


def test_a_stage_whose_first_action_receives_nothing_posts_nothing_at_the_start():
    pipe = LocalPipeline(RunConfig.of(**CONFIG))
    log = []
    first = pipe.stages[0]
    first.transport = LateTransport(first.transport, log)
    first.begin_step(0, *pipe.batch(0))
    assert log == []


def test_prefetched_batches_are_the_steps_own_and_the_run_is_unchanged():
    config = RunConfig.of(**CONFIG)
    batches = StepBatches(config, needs_data=True)
    for step in range(config.steps):
        inputs, targets = batches.take(step)  # split into the run's micro-batches
        expected = batch_for_step(config.model, config.options, config.batch_size, config.seed, step)
        assert len(inputs) == len(targets) == config.layout.microbatches
        assert torch.equal(torch.cat(inputs), expected[0]) and torch.equal(torch.cat(targets), expected[1])
        batches.prefetch()
        batches.prefetch()  # idempotent: one batch ahead
        if step + 1 < config.steps:
            assert batches._ahead is not None and batches._ahead[0] == step + 1
    assert batches._ahead is None  # nothing past the last step
    assert StepBatches(config, needs_data=False).take(0) == (None, None)


def test_the_next_batch_is_drawn_in_the_wait_that_was_longest_last_step():
    config = RunConfig.of(**{**CONFIG, "steps": 5})
    batches = StepBatches(config, needs_data=True)
    batches.take(0)
    batches.prefetch("a")  # no step before: the first wait draws
    assert batches._ahead[0] == 1
    batches.waited("a", 0.001)
    batches.waited("b", 0.005)
    batches.take(1)
    batches.prefetch("a")
    assert batches._ahead is None  # "b" was longer
    batches.waited("a", 0.001)
    batches.prefetch("b")
    assert batches._ahead[0] == 2
    batches.waited("b", 0.004)
    batches.take(2)  # "b" again, but this step its message is there: the wait after it draws
    batches.waited("b", 0.0)
    batches.prefetch("c")
    assert batches._ahead[0] == 3


def test_a_stale_prefetched_batch_is_dropped():
    config = RunConfig.of(**CONFIG)
    batches = StepBatches(config, needs_data=True)
    batches.take(0)
    batches.prefetch()  # step 1 drawn, but step 2 asked for next
    inputs, _ = batches.take(2)
    assert torch.equal(torch.cat(inputs), batch_for_step(config.model, config.options, 8, config.seed, 2)[0])
    batches.prefetch()
    assert batches._ahead is None  # step 3 is past the run


def test_the_host_allocator_keeps_freed_blocks_so_a_step_faults_no_pages_in():
    script = textwrap.dedent("""
        import resource, torch
        from executor.transport.host_allocator import keep_freed_memory
        def faults(steps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(steps):
                grads = [torch.ones(1024, 1024) for _ in range(4)]  # 4 MiB each, freed at the loop's end
                del grads
            return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps
        faults(2)
        print(faults(10), keep_freed_memory(), (faults(2), faults(10))[1])
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=root).stdout.split()
    default_faults, took, kept_faults = float(out[0]), out[1] == "True", float(out[2])
    if not took:
        pytest.skip("this C library has no mallopt settings (not glibc)")
    assert default_faults > 100  # blocks mapped (or the heap trimmed) and faulted in anew each time
    assert kept_faults < 10
