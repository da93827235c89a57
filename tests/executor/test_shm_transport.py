"""Shared-memory links between ranks of one host: messages arrive whole, in any order, double-buffered
per step, and nothing is overwritten before it is copied; a run trains the same either way."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from executor.transport.shm_transport import HostLinks, message_sizes, shared_directory
from tests.helpers import in_process



@pytest.fixture
def pair():
    with shared_directory() as directory:
        links = HostLinks(directory, 0, [0, 1], timeout_s=0.5), HostLinks(directory, 1, [0, 1], timeout_s=0.5)
        yield links
        for link in links:
            link.socket.close()


def layout(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


def recv(links, sender, boundary, channel, microbatch, like):
    """Take a message and copy it out, releasing its slot at once."""
    got = [t.clone() for t in links.take(sender, boundary, channel, microbatch, layout(like))]
    links.release()
    return got


def test_a_message_of_several_tensors_and_dtypes_arrives_whole_each_tensor_a_storage_of_its_own(pair):
    sender, receiver = pair
    assert sender.covers(1) and not sender.covers(0) and not sender.covers(2)
    message = [torch.randn(3, 4), torch.randn(2, 5).to(torch.bfloat16), torch.arange(7), torch.tensor([True, False])]
    sizes = message_sizes(layout(message))
    assert sizes == (48, 20, 56, 2)
    assert not receiver.ready(0, 0, "act", 3, sizes)
    sender.send(1, 0, "act", 3, message)
    assert receiver.ready(0, 0, "act", 3, sizes)
    got = receiver.take(0, 0, "act", 3, layout(message))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, message))
    # taken in place, each its own storage of its own bytes (what the activation counter charges)
    assert [t.untyped_storage().nbytes() for t in got] == [t.nbytes for t in message]
    assert [t.data_ptr() % 64 for t in got] == [0] * 4  # each on a cache line of its own


def test_a_taken_slot_is_not_written_again_until_released(pair):
    sender, receiver = pair
    for value in (1.0, 2.0):
        sender.send(1, 0, "act", 0, [torch.full((2,), value)])
    (first,) = receiver.take(0, 0, "act", 0, [((2,), torch.float32)])  # slot 1, in use
    (second,) = receiver.take(0, 0, "act", 0, [((2,), torch.float32)])  # slot 0
    with pytest.raises(RuntimeError, match="did not take act of micro-batch 0 within"):
        sender.send(1, 0, "act", 0, [torch.full((2,), 3.0)])  # would overwrite `first`
    assert torch.equal(first, torch.full((2,), 1.0)) and torch.equal(second, torch.full((2,), 2.0))
    receiver.release()
    sender.send(1, 0, "act", 0, [torch.full((2,), 3.0)])
    assert torch.equal(recv(receiver, 0, 0, "act", 0, [torch.empty(2)])[0], torch.full((2,), 3.0))


def test_messages_are_taken_by_key_in_any_order_and_each_step_gets_its_own_slot(pair):
    sender, receiver = pair
    steps = [[torch.full((4,), float(10 * step + m)) for m in range(2)] for step in range(2)]
    for step in range(2):  # two steps sent before any is taken: the two slots of each key
        for m in (1, 0):
            sender.send(1, 0, "grad", m, [steps[step][m]])
    for step in range(2):
        for m in (0, 1):
            (got,) = recv(receiver, 0, 0, "grad", m, [torch.empty(4)])
            assert torch.equal(got, steps[step][m])


def test_a_key_whose_size_changes_starts_a_file_of_its_own(pair):
    """The ping-pong calibration sends one key at several sizes: each size counts its own steps."""
    sender, receiver = pair
    for size in (2, 8, 2, 8, 8, 8):
        sender.send(1, 0, "act", 0, [torch.full((size,), float(size))])
        (got,) = recv(receiver, 0, 0, "act", 0, [torch.empty(size)])
        assert torch.equal(got, torch.full((size,), float(size)))


def test_a_sender_two_steps_ahead_waits_for_the_slot_and_says_so_when_it_never_frees(pair):
    sender, receiver = pair
    for value in (1.0, 2.0):
        sender.send(1, 1, "act", 0, [torch.full((2,), value)])
    with pytest.raises(RuntimeError, match="rank 1 did not take act of micro-batch 0 within"):
        sender.send(1, 1, "act", 0, [torch.full((2,), 3.0)])  # its slot still holds the first, not copied
    (first,) = recv(receiver, 0, 1, "act", 0, [torch.empty(2)])
    assert torch.equal(first, torch.full((2,), 1.0))


def test_a_receive_that_never_comes_fails_after_the_timeout(pair):
    _, receiver = pair
    with pytest.raises(RuntimeError, match="no act of micro-batch 5 from rank 0 within"):
        receiver.take(0, 0, "act", 5, [((2,), torch.float32)])


def test_a_message_of_another_size_than_announced_is_not_taken_for_it(pair):
    sender, receiver = pair
    sender.send(1, 0, "act", 0, [torch.zeros(2)])
    assert not receiver.ready(0, 0, "act", 0, message_sizes([((4,), torch.float32)]))
    with pytest.raises(RuntimeError, match="no act of micro-batch 0 from rank 0 within"):
        receiver.take(0, 0, "act", 0, [((4,), torch.float32)])


@pytest.mark.parametrize("plan", [["--stages", "2", "--schedule", "1f1b"], ["--stages", "1", "--replicas", "2"]],
                         ids=["two-stages", "two-replicas"])
def test_training_is_the_same_through_shared_memory_and_gloo(tmp_path, plan):
    """Two stages, or two replicas whose gradients are summed, on this host: the default (shared
    memory) and --transport dist train bitwise the same, and the run's shared directory is gone
    afterwards."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    losses, spans, routes = {}, {}, {}
    for transport in ("auto", "dist"):
        report = tmp_path / f"{transport}.json"
        done = in_process.gpipe("train", "--model", "transformer", "--layers", "2",
                                "--d-model", "16", "--ff", "32", "--heads", "2", "--seq", "8", "--vocab", "32",
                                *plan, "--batch", "8", "--microbatches", "4",
                                "--steps", "3", "--transport", transport, "--report", str(report))
        assert done.returncode == 0, done.stderr[-3000:]
        data = json.loads(report.read_text())
        losses[transport] = data["losses"]
        spans[transport] = [r for r in data["timeline"]["records"] if r["kind"] == "allreduce_dp"]
        routes[transport] = data.get("ranks", [])
    assert losses["auto"] == losses["dist"]
    if "--replicas" in plan:  # both replicas' sums were recorded, each step, and went where asked
        assert len(spans["auto"]) == len(spans["dist"]) == 2 * 3
        assert [r["gradient_sum"] for r in routes["auto"]] == ["shared memory"] * 2
        assert [r["gradient_sum"] for r in routes["dist"]] == ["gloo"] * 2
    if os.path.isdir("/dev/shm"):
        assert not {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("gpipe-shm-")}


def test_a_killed_launchers_directory_is_removed_by_the_next_launch_and_a_live_ones_kept(tmp_path):
    """A launcher killed before its cleanup leaves its message files (memory, under /dev/shm); the
    next launch on the machine removes the directories whose launcher is gone, and only those."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())
    orphan = tmp_path / f"gpipe-shm-{host}-{dead_pid}-abc123"
    orphan.mkdir()
    (orphan / "message").write_bytes(b"x" * 64)
    alive = tmp_path / f"gpipe-shm-{host}-{os.getppid()}-def456"  # the process that started this one
    alive.mkdir()
    elsewhere = tmp_path / f"gpipe-shm-another_{host}-{dead_pid}-ghi789"  # a container sharing /dev/shm
    elsewhere.mkdir()
    older = tmp_path / "gpipe-shm-k2j3h4"  # named before directories carried their launcher's id
    older.mkdir()
    with shared_directory(str(tmp_path)) as directory:
        assert not orphan.exists() and alive.exists() and elsewhere.exists() and older.exists()
        assert os.path.basename(directory).startswith(f"gpipe-shm-{host}-{os.getpid()}-")
    assert not os.path.exists(directory)
