"""tests/helpers/in_process.py gives back what a new interpreter's run of gpipe would, and leaves no trace."""

from __future__ import annotations

import os
import sys

from tests.helpers import in_process


def test_a_command_runs_in_the_directory_asked_for_with_its_output_and_status(tmp_path):
    here, environment = os.getcwd(), dict(os.environ)
    done = in_process.gpipe("plan", "--model", "uniform", "--layers", "4", "--batch", "8", "--hardware",
                            "v100-nvlink", "--out", "plan.json", "--quiet", cwd=tmp_path, env={"GPIPE_TEST_MARK": "1"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plan.json").exists() and not os.path.exists(os.path.join(in_process.ROOT, "plan.json"))
    assert os.getcwd() == here and dict(os.environ) == environment and sys.stdout is not None
    refused = in_process.gpipe("simulate", "--no-such-flag")
    assert refused.returncode == 2 and "gpipe simulate takes no flag --no-such-flag" in refused.stderr
    assert refused.stdout == ""
