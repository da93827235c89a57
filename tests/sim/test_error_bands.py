"""The error bands every GPU prediction is printed with: built from the validation set alone."""

import json
import os

import pytest

from sim.errors import GpipeInputError
from sim.evidence.error_bands import UNKNOWN, band_field, band_for, bands_path, build_bands, load_bands, regime_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.path.join(ROOT, "benchmarks", "published_runs", "dev.json")
VALIDATION = os.path.join(ROOT, "benchmarks", "published_runs", "validation.json")
VALIDATION_MOE = os.path.join(ROOT, "benchmarks", "published_runs", "validation_moe.json")


def _ids(path):
    with open(path) as handle:
        data = json.load(handle)
    return {r["id"] for r in data["runs"]} | {r["id"] for r in data.get("layer_times", [])}


def test_the_shipped_bands_come_from_the_validation_set_alone():
    with open(bands_path()) as handle:
        text = handle.read()
    shipped = json.loads(text)
    assert shipped["source"] == ("benchmarks/published_runs/validation.json "
                                 "benchmarks/published_runs/validation_moe.json")
    assert set(shipped["runs"]) <= _ids(VALIDATION) | _ids(VALIDATION_MOE)
    dev_only = _ids(DEV) - _ids(VALIDATION) - _ids(VALIDATION_MOE)
    assert dev_only and not dev_only & set(shipped["runs"])
    for dev_id in dev_only:
        assert f'"{dev_id}"' not in text


def test_a_regime_with_few_runs_falls_back_to_the_device():
    rows = [("X", "bf16 flat", e) for e in (-0.1, 0.0, 0.05, 0.1, 0.2)] + [("X", "fp8 flat", 0.3)]
    bands = build_bands(rows, "runs.json")
    assert list(bands["devices"]["X"]["regimes"]) == ["bf16 flat"]
    assert band_for("X", "bf16", 1, bands).regime == "bf16 flat"
    fallback = band_for("X", "fp8", 1, bands)
    assert (fallback.regime, fallback.count) == ("all", 6)
    assert band_for("Y", "bf16", 1, bands) is None
    assert regime_key("bf16-model", 4) == "bf16 pipelined" and regime_key("fp8", 1) == "fp8 flat"


def test_cpu_and_ideal_carry_no_band_and_an_unreplayed_device_says_so():
    assert band_field("cpu", "cpu", "fp32", 2) is None
    assert band_field("ideal", "ideal", "fp32", 2) is None
    assert band_field("mi300x", "MI300X-192GB", "bf16", 2)["text"] == UNKNOWN


def test_a_malformed_bands_file_is_one_line(tmp_path):
    bad = tmp_path / "bands.json"
    bad.write_text(json.dumps({"devices": {"H100-SXM-80GB": {"all": {"low": -0.1, "count": 3}}}}))
    with pytest.raises(GpipeInputError, match="H100-SXM-80GB's 'all' needs numbers low, high") as caught:
        load_bands(str(bad))
    assert "\n" not in str(caught.value)
    bad.write_text("{not json")
    with pytest.raises(GpipeInputError, match="cannot be read"):
        load_bands(str(bad))
