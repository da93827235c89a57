"""The launcher (executor.launch.agent, executor.launch.rank_process): ranks forked from the fork server are what
``python -u -m MODULE`` under torchrun would start, and their failures come back as the agent saw them."""

import json
import os
import textwrap

import pytest

from executor.launch.agent import agent_config, killed_by_signal, launch, launch_captured, start_fork_server

PROBE = textwrap.dedent('''
    import json, os, sys, time
    rank = int(os.environ["RANK"])
    mode = sys.argv[1]
    sys.stdout.write(f"out of rank {rank}\\n")  # one write each: print's text and newline are two, which
    sys.stderr.write(f"err of rank {rank}\\n")  # the two ranks' unbuffered streams can interleave
    with open(f"rank{rank}.json", "w") as handle:
        json.dump({"cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"), "home": os.environ.get("HOME"),
                   "world": os.environ["WORLD_SIZE"], "argv": sys.argv, "name": __name__,
                   "helper": __import__("probe_helper").VALUE}, handle)
    if mode == "exit" and rank == 1:
        sys.exit(3)
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), 9)
    if mode == "hang" and rank == 0:
        time.sleep(60)
''')


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe_rank.py").write_text(PROBE)
    (tmp_path / "probe_helper.py").write_text("VALUE = 'found in the working directory'\n")
    monkeypatch.chdir(tmp_path)
    start_fork_server()  # as gpipe train does: the server's environment is this process's now
    env = {key: value for key, value in os.environ.items() if key != "HOME"}
    env["PROBE_MARKER"] = "set for this launch only"
    return tmp_path, env


def test_a_forked_rank_has_the_launchs_directory_environment_arguments_and_output(probe):
    directory, env = probe
    out, err = directory / "out.txt", directory / "err.txt"
    with open(out, "w") as out_file, open(err, "w") as err_file:
        outcome = launch(agent_config(2), "probe_rank", ["ok"], env, out_file.fileno(), err_file.fileno())
    assert not outcome.failed
    for rank in (0, 1):
        seen = json.loads((directory / f"rank{rank}.json").read_text())
        assert seen == {"cwd": str(directory), "marker": "set for this launch only", "home": None, "world": "2",
                        "argv": [str(directory / "probe_rank.py"), "ok"], "name": "__main__", "helper": "found in the working directory"}
    assert sorted(out.read_text().splitlines()) == ["out of rank 0", "out of rank 1"]
    assert sorted(err.read_text().splitlines()) == ["err of rank 0", "err of rank 1"]


def test_a_ranks_exit_code_and_a_signal_come_back_as_the_root_failure(probe):
    _, env = probe
    outcome, output = launch_captured("probe_rank", ["exit"], 2, env)
    assert (outcome.failed, outcome.rank, outcome.exitcode) == (True, 1, 3)
    assert "err of rank 1" in output
    outcome, _ = launch_captured("probe_rank", ["kill"], 2, env)
    assert (outcome.rank, outcome.exitcode) == (1, -9)
    assert killed_by_signal(outcome, node=0).message == "killed by signal 9 (SIGKILL)"


def test_a_rank_past_its_timeout_prints_its_stack_and_ends(probe):
    _, env = probe
    outcome, output = launch_captured("probe_rank", ["hang"], 2, env, timeout_s=2)
    assert (outcome.failed, outcome.rank, outcome.exitcode) == (True, 0, 1)
    assert "Timeout" in output and "probe_rank.py" in output


def session_processes(session):
    """The command lines of the live processes in session ``session``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            if int(fields[4]) == session and fields[0] != "Z":
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    found.append(handle.read().replace(b"\0", b" ").decode(errors="replace")[:120])
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.slow
def test_gpipe_train_stopped_by_sigterm_ends_its_ranks_and_says_so(tmp_path):
    """The agent runs in ``gpipe train``'s own process: a SIGTERM sent to it (a scheduler's, say) ends the
    ranks, the fork server and the command, which names the signal and exits 128 + 15."""
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    err = tmp_path / "err.txt"
    with open(tmp_path / "out.txt", "w") as out, open(err, "w") as err_file:
        process = subprocess.Popen([sys.executable, "-m", "gpipe.main", "train", "--model", "mlp", "--stages", "2",
                                    "--steps", "100000"], cwd=root, stdout=out, stderr=err_file,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "gpipe: step 0 " not in (tmp_path / "out.txt").read_text() + err.read_text():
            assert process.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        deadline = time.monotonic() + 10
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_processes(process.pid)  # nothing of the run is left
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code == 128 + signal.SIGTERM
    assert "gpipe: error: training stopped by SIGTERM; its ranks were ended" in err.read_text()


def test_a_rendezvous_nobody_comes_to_is_the_agents_own_error(probe, tmp_path):
    """Node 1 of 2 waits for node 0's store, which never opens: after --rdzv-timeout the agent itself
    fails, and gpipe train's line says so with what to check."""
    import argparse
    import socket

    from executor.launch.agent import run_ranks

    _, env = probe
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = argparse.Namespace(nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_timeout=2,
                              rdzv_id="nobody-comes", max_restarts=0)
    errors = tmp_path / "errors"
    errors.mkdir()
    code, message = run_ranks("probe_rank", ["ok"], 2, env, str(errors), args)
    assert code == 1
    assert message.startswith("gpipe: error: training failed: the launch failed (")
    assert message.endswith("; check that every node was started with the same flags and --nnodes, node 0's "
                            "address as --rdzv-endpoint and a distinct --node-rank, within --rdzv-timeout")
    assert not list(tmp_path.glob("rank*.json"))  # no rank started
