"""Shared fixtures: small workloads with distinct stash and saved sizes, and one quick calibration."""

from __future__ import annotations

import pytest

from tests.helpers.scenarios import ListWorkload


@pytest.fixture
def list_workload():
    return ListWorkload


@pytest.fixture(scope="session")
def tiny_quick_costs(tmp_path_factory):
    """One quick calibration of the tiny transformer (``tests.helpers.costs.TINY``), shared
    by the tests that validate against it (a calibration is the slowest launch there is): the costs
    file's path and what the command printed."""
    import contextlib
    import io

    from gpipe.main import main
    from tests.helpers.costs import TINY

    path = tmp_path_factory.mktemp("tiny_quick") / "costs.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["calibrate", *TINY, "--out", str(path), "--quick", "--steps", "3"]) == 0
    return str(path), printed.getvalue()
