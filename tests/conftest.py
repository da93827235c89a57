"""Shared fixtures: small workloads with distinct stash and saved sizes, and one quick calibration."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.scenarios import ListWorkload


@pytest.fixture(autouse=True)
def one_torch_thread_in_the_test_process():
    """Torch in this process (the in-process pipelines, the references they are compared with) on one
    thread. Why: their tensors are tiny, and on a 2-core machine that other jobs load, two threads
    meeting at every operator wait for each other (one small transformer's five AdamW steps took 15
    times as long on two as on one). Both sides of every comparison run in this process, so they still
    run alike; workers, calibration's profile and its speed probe set their own thread counts. Only
    where torch is loaded already: a test that needs no torch does not import it for this."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


@pytest.fixture
def list_workload():
    return ListWorkload


@pytest.fixture(scope="session")
def tiny_quick_costs(tmp_path_factory):
    """One quick calibration of the tiny transformer (``tests.helpers.costs.TINY``), shared
    by the tests that validate against it (a calibration is the slowest launch there is): the costs
    file's path and what the command printed. A calibration the machine's drift got refused
    (calibrate.fit.design_checks) is taken once more from the start, as ``gpipe demo`` does."""
    import contextlib
    import io

    from gpipe.main import main
    from tests.helpers.costs import TINY

    path = tmp_path_factory.mktemp("tiny_quick") / "costs.json"
    for attempt in (1, 2):
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            status = main(["calibrate", *TINY, "--out", str(path), "--quick", "--steps", "3"])
        if status == 0 or "calibration refused" not in errors.getvalue() or attempt == 2:
            break
    assert status == 0, errors.getvalue()
    return str(path), printed.getvalue()
