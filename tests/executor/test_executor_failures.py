"""Failure records, how gpipe train picks the one it prints, the watchdog on a real store, and the
settings and outputs the nodes of one run share (executor.launch.failures, executor.launch.agent, executor.launch.nodes)."""

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from executor.config import RunConfig
from executor.launch import failures, nodes
from executor.launch.agent import LaunchOutcome, killed_by_signal
from executor.launch.failures import PEER, RAISED, REMOTE, FailureRecord, Watchdog, pick_failure
from sim.errors import GpipeInputError

GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                  "peer [127.0.0.1]:39604. This is typically caused by a remote worker crashing.")


def test_a_failure_is_described_from_the_node_that_reads_it():
    record = FailureRecord(node=1, rank=3, message="RuntimeError: boom")
    assert record.describe(this_node=1) == "rank 3: RuntimeError: boom"
    assert record.describe(this_node=0) == "on node 1: rank 3: RuntimeError: boom"
    lost = FailureRecord(node=0, rank=None, message="lost contact with its rendezvous store", kind=REMOTE)
    assert lost.describe(this_node=1) == "on node 0: lost contact with its rendezvous store"
    assert FailureRecord.from_json(record.to_json()) == record


def test_gpipe_train_prefers_the_original_error_to_its_consequences():
    raised = FailureRecord(1, 3, "RuntimeError: boom", RAISED)
    remote = FailureRecord(1, 3, "RuntimeError: boom", REMOTE)
    peer = FailureRecord(0, 1, GLOO_PEER_GONE, PEER)
    killed = FailureRecord(1, 2, "killed by signal 9 (SIGKILL)")
    assert pick_failure([peer, remote, raised], killed) is raised
    assert pick_failure([peer, remote], killed) is killed
    assert pick_failure([peer, remote], None) is remote
    assert pick_failure([peer], None) is peer
    assert pick_failure([], None) is None


def test_the_agents_root_failure_names_the_rank_a_signal_killed():
    assert killed_by_signal(LaunchOutcome(True, rank=3, exitcode=-9), node=1) == \
        FailureRecord(1, 3, "killed by signal 9 (SIGKILL)")
    assert killed_by_signal(LaunchOutcome(True, rank=3, exitcode=1), node=1) is None
    assert killed_by_signal(LaunchOutcome(True, agent_error="DistStoreError: timed out"), node=0) is None


def test_a_lost_peer_is_told_from_an_error_of_its_own():
    assert failures.is_peer_loss(RuntimeError(GLOO_PEER_GONE))
    assert not failures.is_peer_loss(RuntimeError("injected fault on rank 3 at step 1 after 3F0"))
    assert not failures.is_peer_loss(ValueError("shapes (2, 3) and (4, 5) do not match"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    return server, ("127.0.0.1", port)


def watch(endpoint, **kwargs):
    seen, done = [], threading.Event()

    def abort(record):
        seen.append(record)
        done.set()

    return Watchdog(endpoint, rank=1, node=0, attempt=0, poll_s=0.05, abort=abort, **kwargs).start(), seen, done


def test_the_watchdog_stops_a_rank_when_another_node_fails(store):
    _, endpoint = store
    watchdog, seen, done = watch(endpoint)
    time.sleep(0.3)
    assert not done.is_set()
    assert failures.post_to(endpoint, 0, FailureRecord(1, 3, "RuntimeError: boom"))
    assert done.wait(5)
    assert seen[0].describe(this_node=0) == "on node 1: rank 3: RuntimeError: boom"
    # the first failure stands: a later one (a consequence) does not replace it
    assert failures.post(failures.connect(*endpoint), 0, FailureRecord(0, 1, "lost peer")).rank == 3
    watchdog.stop()


def test_the_watchdog_ignores_its_own_failure_and_other_attempts(store):
    _, endpoint = store
    watchdog, _, done = watch(endpoint)
    failures.post_to(endpoint, 0, FailureRecord(0, 1, "mine"))  # rank 1 is the watchdog's own rank
    failures.post_to(endpoint, 1, FailureRecord(1, 3, "a later attempt's"))
    assert not done.wait(0.5)
    watchdog.stop()


@pytest.mark.slow  # a process of its own hosts the store
def test_the_watchdog_stops_a_rank_when_the_store_is_gone():
    import subprocess
    import sys

    port = free_port()
    script = ("import time, torch.distributed as d; "
              f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
              "print('up', flush=True); time.sleep(60)")
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        watchdog, seen, done = watch(("127.0.0.1", port), lost_after_s=1.0)
        assert not done.wait(0.5)
        host.kill()
        gone = time.monotonic()
        assert done.wait(15)
        assert time.monotonic() - gone < 1.0 + failures.STORE_TIMEOUT_S + 1
        expected = f"on node 0: lost contact with its rendezvous store at 127.0.0.1:{port}"
        assert seen[0].describe(this_node=1).startswith(expected)
        watchdog.stop()
    finally:
        host.kill()
        host.wait()


def test_posting_to_a_store_that_is_gone_returns_at_once():
    started = time.monotonic()
    assert not failures.post_to(("127.0.0.1", free_port()), 0, FailureRecord(1, 3, "killed by signal 9"))
    assert time.monotonic() - started < 2


def views(*settings_per_rank, per_node=2):
    return [nodes.NodeView(rank, rank // per_node, settings) for rank, settings in enumerate(settings_per_rank)]


def test_nodes_started_with_other_settings_are_refused_with_one_line():
    base = RunConfig.of(model="mlp", partition=(2, 2, 2, 2)).to_dict()
    ok = views(base, base, {**base, "report": "r1.json", "threads": 3}, {**base, "report": "r1.json"})
    nodes.check_same_settings(ok)  # output paths and threads are each node's own
    other = views(base, base, {**base, "steps": 20}, {**base, "steps": 20})
    with pytest.raises(GpipeInputError) as error:
        nodes.check_same_settings(other)
    assert str(error.value) == ("node 1 was started with steps = 20 but node 0 with 10; start every node's "
                                "gpipe train with the same flags")


def test_the_report_goes_to_the_first_rank_of_each_other_node_that_asked():
    base = RunConfig.of(model="mlp", partition=(1,) * 6).to_dict()
    asked = {**base, "report": "r.json"}
    traced = {**base, "trace": "t.json"}
    assert nodes.output_writers(views(asked, asked, base, base, traced, traced)) == {4: ("", "t.json")}
    assert nodes.output_writers(views(base, base, asked, asked, base, base)) == {2: ("r.json", "")}
    assert nodes.output_writers(views(asked, asked, base, base, base, base)) == {}
