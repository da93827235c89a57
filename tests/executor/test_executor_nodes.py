"""Two "nodes" on this machine: two gpipe train commands joined through a 127.0.0.1 rendezvous.

Node n runs stages n*K/2 onwards whatever order the commands start in, node 0 (stage 0) writes the
report, and a failure on node 1 ends both commands, each with the original error.
"""

import json
import time

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.nodes import Node, free_port

pytestmark = pytest.mark.slow


def in_rendezvous(node):
    """Whether ``node`` (started with ``LOGLEVEL=INFO``) has reached the rendezvous: its agent says so."""
    return "Rendezvous'ing worker group" in node.err.read_text()


def local_losses(stages, steps):
    config = RunConfig.of(model="mlp", options={"width": 16}, batch_size=10, microbatches=4,
                       partition=(8 // stages,) * stages)
    pipe = LocalPipeline(config)
    return [pipe.run_step(s) for s in range(steps)]


@pytest.mark.parametrize("stages,first", [(2, 0), (4, 1)])
def test_two_nodes_train_as_one_whichever_starts_first(tmp_path, stages, first):
    port = free_port()
    flags = {0: ["--report", str(tmp_path / "r0.json"), "--trace", str(tmp_path / "t0.json")], 1: []}
    if stages == 2:
        flags[1] = ["--report", str(tmp_path / "r1.json")]  # asked on node 1 too: written there as well
    common = ["--stages", str(stages), "--steps", "3"]
    nodes = {first: Node(tmp_path, first, port, *common, *flags[first], env={"LOGLEVEL": "INFO"})}
    if first == 1:  # node 0 starts only once node 1 waits for it in the rendezvous
        deadline = time.monotonic() + 60
        while not in_rendezvous(nodes[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_rendezvous(nodes[1])
    nodes[1 - first] = Node(tmp_path, 1 - first, port, *common, *flags[1 - first])
    codes = {rank: node.wait() for rank, node in nodes.items()}
    assert codes == {0: 0, 1: 0}, {rank: node.stderr[-3000:] for rank, node in nodes.items()}
    report = json.loads((tmp_path / "r0.json").read_text())
    assert report["losses"] == pytest.approx(local_losses(stages, 3), rel=1e-6, abs=1e-7)
    assert [s["stage"] for s in report["stages"]] == list(range(stages))
    assert all(s["peak_activation_bytes"] > 0 and s["busy_s"] > 0 for s in report["stages"])
    assert {r["stage"] for r in report["timeline"]["records"]} == set(range(stages))
    assert json.loads((tmp_path / "t0.json").read_text())["traceEvents"]
    # the last stage lives on node 1, which prints the losses; each node that wrote a report says so
    assert "gpipe: step 2 loss" in nodes[1].stdout and "gpipe: step" not in nodes[0].stdout
    assert "gpipe: trained 3 steps" in nodes[0].stdout
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    if stages == 2:
        assert written == ["r0.json", "r1.json", "t0.json"]
        assert json.loads((tmp_path / "r1.json").read_text()) == report
        assert "gpipe: trained 3 steps" in nodes[1].stdout
    else:
        assert written == ["r0.json", "t0.json"]


@pytest.mark.parametrize("mode,error", [
    ("raise", "rank 3: RuntimeError: injected fault on rank 3 at step 1 after 3F0"),
    ("kill", "rank 3: killed by signal 9 (SIGKILL)"),
])
def test_a_failure_on_node_1_ends_both_nodes_with_the_original_error(tmp_path, mode, error):
    port = free_port()
    fault = {"GPIPE_FAULT_RANK": "3", "GPIPE_FAULT_STEP": "1", "GPIPE_FAULT": mode}
    common = ["--stages", "4", "--steps", "100"]
    nodes = [Node(tmp_path, 0, port, *common, "--report", str(tmp_path / "r0.json"), env=fault),
             Node(tmp_path, 1, port, *common, env=fault)]
    codes = [node.wait() for node in nodes]
    assert all(code != 0 for code in codes), [node.stderr[-3000:] for node in nodes]
    assert [node.stderr.strip().splitlines()[-1] for node in nodes] == [
        f"gpipe: error: training failed on node 1: {error}", f"gpipe: error: training failed: {error}"]
    # ended by the failure, well before the 300 s receive timeout would end it (slow machines included)
    assert all(node.elapsed < 120 for node in nodes), [node.elapsed for node in nodes]
    assert "gpipe: step 99" not in nodes[1].stdout and not (tmp_path / "r0.json").exists()


def test_a_killed_worker_on_node_1_is_restarted_on_both_nodes_from_the_last_checkpoint(tmp_path):
    port = free_port()
    fault = {"GPIPE_FAULT_RANK": "3", "GPIPE_FAULT_STEP": "2", "GPIPE_FAULT": "kill"}
    common = ["--stages", "4", "--steps", "4", "--save-every", "1", "--checkpoint-dir", str(tmp_path / "ck"),
              "--max-restarts", "1"]
    nodes = [Node(tmp_path, 0, port, *common, "--report", str(tmp_path / "r0.json"), env=fault),
             Node(tmp_path, 1, port, *common, env=fault)]
    codes = [node.wait() for node in nodes]
    assert codes == [0, 0], [node.stderr[-3000:] for node in nodes]
    assert nodes[1].stdout.count("gpipe: step 2 loss") == 1  # step 2 ran once, after the restart
    report = json.loads((tmp_path / "r0.json").read_text())
    assert report["losses"] == pytest.approx(local_losses(4, 4), rel=1e-6, abs=1e-7)
