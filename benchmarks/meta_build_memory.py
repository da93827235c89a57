"""Peak resident memory of every process of ``gpipe train`` for a model no process may build whole.

An 8-layer, 8192-wide MLP holds 8 x (8192 x 8192 + 8192) fp32 parameters, 2.1 GB. At K=4 each
worker materialises its two layers only (executor.materialize); the launcher checks shapes on the
meta device and allocates nothing. This script runs the real command, samples the peak resident set
(VmHWM in /proc/PID/status) of the launcher and every process under it until they exit, and writes
the figures with the goal: each process below 0.8 x the whole model's bytes.

    .venv/bin/python benchmarks/meta_build_memory.py [out.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sim.timeline import write_json_atomic  # noqa: E402

LAYERS, WIDTH, STAGES = 8, 8192, 4
MODEL_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
GOAL = 0.8


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo.extend(_children(current))
    return pids


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


def main(out_path: str) -> int:
    command = [sys.executable, "-m", "sim.cli", "train", "--model", "mlp", "--layers", str(LAYERS), "--width",
               str(WIDTH), "--stages", str(STAGES), "--batch", "8", "--microbatches", "4", "--steps", "2",
               "--threads", "1"]
    started = time.perf_counter()
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[str, int]] = {}
    while launcher.poll() is None:
        for pid in _tree(launcher.pid):
            status = _status(pid)
            if status is not None and status[1] >= peaks.get(pid, ("", 0))[1]:
                peaks[pid] = status
        time.sleep(0.05)
    output = launcher.stdout.read() if launcher.stdout else ""
    if launcher.returncode != 0:
        print(output, file=sys.stderr)
        return 1
    rows = []
    for pid, (cmd, kib) in sorted(peaks.items()):
        role = ("torchrun" if "torch.distributed.run" in cmd else "worker" if "executor.worker" in cmd
                else "launcher" if "sim.cli" in cmd else "other")
        rows.append({"pid": pid, "role": role, "peak_rss_bytes": kib * 1024,
                     "fraction_of_model": kib * 1024 / MODEL_BYTES})
    worst = max(r["fraction_of_model"] for r in rows)
    result = {"model": f"mlp {LAYERS} layers x {WIDTH}", "model_bytes": MODEL_BYTES, "stages": STAGES,
              "goal_fraction": GOAL, "worst_fraction": worst, "met": worst < GOAL, "processes": rows,
              "wall_s": time.perf_counter() - started, "command": " ".join(command[1:])}
    write_json_atomic(out_path, result)
    for r in rows:
        print(f"{r['role']:>9} pid {r['pid']:>7}: peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB "
              f"= {r['fraction_of_model']:.2f} x the model")
    print(f"model {MODEL_BYTES / 1e9:.2f} GB; worst process {worst:.2f} x (goal < {GOAL}); written to {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "benchmarks", "results",
                                                                       "meta_build_memory.json")))
