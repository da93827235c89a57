"""Two nodes of one run on this host: a free rendezvous port, and a ``gpipe train --nnodes 2`` node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = ["--model", "mlp", "--option", "width=16", "--batch", "10", "--microbatches", "4"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One ``gpipe train --nnodes 2 --node-rank R`` command, its output kept in files."""

    def __init__(self, tmp_path, rank, port, *flags, env=None):
        self.rank = rank
        self.out, self.err = tmp_path / f"node{rank}.out", tmp_path / f"node{rank}.err"
        command = [sys.executable, "-m", "gpipe.main", "train", *MLP, *flags, "--nnodes", "2", "--node-rank", str(rank),
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "90"]
        self.started = time.monotonic()
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True,
                                            env=dict(os.environ, **(env or {})), start_new_session=True)

    def wait(self, timeout=150):
        try:
            code = self.process.wait(timeout=timeout)
        finally:  # a hung node takes its workers with it (they share its session)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.elapsed = time.monotonic() - self.started
        self.stdout, self.stderr = self.out.read_text(), self.err.read_text()
        return code
