"""Peak resident memory of every process of ``gpipe train``, for each place first weights come from.

An 8-layer, 8192-wide MLP holds 8 x (8192 x 8192 + 8192) fp32 parameters, 2.1 GB; K=4, SGD. With
``--init factory`` (the default) the launcher builds ``factory()`` once, writes it to safetensors
per layer and frees it, and each worker reads its two layers (executor.models.initial_weights); goals: each
worker at most 0.8 x the model's bytes, the launcher at most 1.3 x. With ``--init meta`` no process
builds the whole model (executor.models.materialize); goal: every process at most 0.8 x. This script runs
the real command for each, samples the peak resident set (VmHWM in /proc/PID/status) of the
launcher and every process under it (its fork server and the ranks forked from that) until they
exit, and writes the figures with the goals.

    .venv/bin/python benchmarks/init_memory.py [out.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sim.formats.timeline import write_json_atomic  # noqa: E402

LAYERS, WIDTH, STAGES = 8, 8192, 4
MODEL_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
GOALS = {"factory": {"launcher": 1.3, "worker": 0.8}, "meta": {"launcher": 0.8, "worker": 0.8}}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> dict[int, int]:
    """Every process under ``pid`` (itself included), each with its parent."""
    parents, todo = {pid: 0}, [pid]
    while todo:
        current = todo.pop()
        for child in _children(current):
            parents[child] = current
            todo.append(child)
    return parents


def _status(pid: int) -> tuple[str, int] | None:
    """(command, peak resident kB) of a live process."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return command, int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def measure(init: str) -> dict:
    """Run ``gpipe train --init INIT`` and sample every process's peak resident set."""
    command = [sys.executable, "-m", "gpipe.main", "train", "--model", "mlp", "--layers", str(LAYERS), "--width",
               str(WIDTH), "--stages", str(STAGES), "--batch", "8", "--microbatches", "4", "--steps", "2",
               "--optimizer", "sgd", "--threads", "1", "--init", init]
    started = time.perf_counter()
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[str, int]] = {}
    parents: dict[int, int] = {}
    while launcher.poll() is None:
        for pid, parent in _tree(launcher.pid).items():
            parents[pid] = parent
            status = _status(pid)
            if status is not None and status[1] >= peaks.get(pid, ("", 0))[1]:
                peaks[pid] = status
        time.sleep(0.05)
    output = launcher.stdout.read() if launcher.stdout else ""
    if launcher.returncode != 0:
        raise RuntimeError(output)
    rows = []
    for pid, (cmd, kib) in sorted(peaks.items()):
        # the ranks are forked from the launcher's fork server (executor.launch.agent): its command line, its children
        server = "multiprocessing.forkserver" in cmd and parents.get(pid) == launcher.pid
        rank = "multiprocessing.forkserver" in peaks.get(parents.get(pid, 0), ("", 0))[0]
        role = ("launcher" if pid == launcher.pid else "fork server" if server else "worker" if rank else "other")
        goal = GOALS[init].get(role)
        rows.append({"pid": pid, "role": role, "peak_rss_bytes": kib * 1024,
                     "fraction_of_model": kib * 1024 / MODEL_BYTES, "goal_fraction": goal,
                     "met": goal is None or kib * 1024 / MODEL_BYTES <= goal})
    return {"init": init, "processes": rows, "met": all(r["met"] for r in rows),
            "wall_s": time.perf_counter() - started, "command": " ".join(command[1:])}


def main(out_path: str) -> int:
    runs = [measure(init) for init in GOALS]
    result = {"model": f"mlp {LAYERS} layers x {WIDTH}", "model_bytes": MODEL_BYTES, "stages": STAGES,
              "goals": GOALS, "runs": runs, "met": all(run["met"] for run in runs)}
    write_json_atomic(out_path, result)
    for run in runs:
        print(f"--init {run['init']}: {run['command']}")
        for r in run["processes"]:
            goal = f" (goal <= {r['goal_fraction']})" if r["goal_fraction"] else ""
            print(f"  {r['role']:>9} pid {r['pid']:>7}: peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB "
                  f"= {r['fraction_of_model']:.2f} x the model{goal}")
    print(f"model {MODEL_BYTES / 1e9:.2f} GB; goals met: {result['met']}; written to {out_path}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "benchmarks", "results",
                                                                       "init_memory.json")))
