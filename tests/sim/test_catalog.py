"""The 2026 hardware catalog: every entry sourced, priced or said to be unpriced, the datasheet figures
as published, and the full-mesh and rack-scale layouts the planner relies on; the catalog's files give
exactly the figures the catalog had in code."""

import json
import os
from dataclasses import asdict, replace

import pytest

from sim.catalog.efficiency_note import efficiency_kind, efficiency_text
from sim.catalog.hardware import (CATALOG_FILES, DEFAULT_EFFICIENCY, GB, LINKS, LINKS_FILE, SYSTEMS, SYSTEMS_DIR, TERA,
                                  get_system)
from sim.engine.allreduce import ring_allreduce_s
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.workloads.models import get_workload

# Systems without an on-demand list price in the catalog (users pass --price-per-device-hour).
UNPRICED = {"ideal", "cpu", "p100-pcie", "v100-nvlink", "gb200-nvl72", "tpu-v2", "tpu-v3", "tpu-v4", "tpu-v5e",
            "tpu-v5p", "tpu-v6e"}
FP8 = {"h100-nvlink", "h100-pcie", "h200-nvlink", "b200-nvlink", "gb200-nvl72", "mi300x", "mi325x"}
NEW_2026 = ["b200-nvlink", "gb200-nvl72", "mi300x", "mi325x", "tpu-v5e", "tpu-v5p", "tpu-v6e"]
NVLINK5, INFINITY_FABRIC = LINKS["NVLink5"], LINKS["InfinityFabric"]
SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "catalog_snapshot.json")


def _figures(system) -> dict:
    """A system's fields as JSON has them, without the device's and the system's source texts, nor
    the span of a device in the pipeline's view of tensor- and context-parallel groups (1 in the
    catalog: every device on one node)."""
    data = json.loads(json.dumps(asdict(system)))  # tuples as lists, inf as JSON's Infinity
    assert data.pop("nodes_per_device") == 1
    del data["source"], data["device"]["source"]
    return data


@pytest.mark.parametrize("name", [name for name in SYSTEMS if name != "cpu"])  # cpu: this machine's counts
def test_every_system_has_the_figures_the_catalog_had_in_code(name):
    with open(SNAPSHOT) as handle:
        expected = json.load(handle)["systems"][name]
    assert _figures(get_system(name, fitted=False)) == expected


def test_every_system_file_is_listed_in_order_and_names_itself():
    with open(os.path.join(SYSTEMS_DIR, "index.json")) as handle:
        listed = json.load(handle)["systems"]
    files = sorted(name[:-5] for name in os.listdir(SYSTEMS_DIR) if name.endswith(".json") and name != "index.json")
    assert sorted(listed) == files and list(CATALOG_FILES) == listed
    assert list(SYSTEMS) == ["ideal", "cpu", *listed]  # the order --hardware lists them in
    assert all(data["name"] == name for name, data in CATALOG_FILES.items())


@pytest.mark.parametrize("name", list(CATALOG_FILES))
def test_every_file_cites_the_device_the_system_and_any_price(name):
    sources = CATALOG_FILES[name]["sources"]
    assert sources["device"] and sources["system"]
    assert ("price_per_device_hour" in sources) == (CATALOG_FILES[name]["price_per_device_hour"] is not None)
    with open(LINKS_FILE) as handle:
        assert all(link["source"] for link in json.load(handle)["links"])


def test_the_catalog_has_todays_accelerators():
    assert set(NEW_2026) <= set(SYSTEMS)
    assert {"a100-nvlink", "a100-40gb-nvlink", "h100-nvlink", "h100-pcie", "h200-nvlink"} <= set(SYSTEMS)


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_every_figure_names_its_source(name):
    system = SYSTEMS[name]
    assert system.source and system.device.source
    assert system.intra_link.source and system.inter_link.source or name in ("ideal", "cpu")


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_every_system_is_priced_with_a_dated_source_or_listed_unpriced(name):
    system = SYSTEMS[name]
    if name in UNPRICED:
        assert system.price_per_device_hour is None and system.price_source == ""
    else:
        assert 0.5 < system.price_per_device_hour < 10
        assert "2026" in system.price_source and "on demand" in system.price_source


def test_fp8_exactly_where_the_datasheets_list_fp8_tensor_cores():
    assert {name for name, s in SYSTEMS.items() if "fp8" in s.device.peak_flops} == FP8
    for name in FP8:  # dense fp8 is twice dense bf16 on every one of them
        peaks = SYSTEMS[name].device.peak_flops
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.01)


@pytest.mark.parametrize("name,bf16_tflops,fp8_tflops,memory_gb,bandwidth_gb_s", [
    ("b200-nvlink", 2250, 4500, 180, 7700),
    ("gb200-nvl72", 2500, 5000, 186, 8000),
    ("mi300x", 1307.4, 2614.9, 192, 5300),
    ("mi325x", 1307.4, 2614.9, 256, 6000),
    ("h100-pcie", 756, 1513, None, 2000),
    ("h200-nvlink", 989.4, 1978.9, 141, 4800),
    ("tpu-v5e", 197, None, 16, 819),
    ("tpu-v5p", 459, None, 95, 2765),
    ("tpu-v6e", 918, None, 32, 1640),
])
def test_datasheet_figures(name, bf16_tflops, fp8_tflops, memory_gb, bandwidth_gb_s):
    device = SYSTEMS[name].device
    assert device.peak_flops["bf16"] == pytest.approx(bf16_tflops * TERA)
    assert device.peak_flops.get("fp8") == (None if fp8_tflops is None else pytest.approx(fp8_tflops * TERA))
    if memory_gb is not None:
        assert device.memory_bytes == pytest.approx(memory_gb * GB)
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth_gb_s * GB)
    assert device.default_precision == "bf16"
    assert device.flash_attention == (not name.startswith("tpu"))


def test_gb200_is_one_nvlink_domain_of_72_and_tensor_parallel_stays_in_it():
    system = get_system("gb200-nvl72", nodes=2, fitted=False)  # the catalog's links at their peak
    assert system.devices_per_node == 72 and system.total_devices == 144
    assert system.link_between(0, 71) is NVLINK5 and system.link_between(71, 72).name == "InfiniBand-NDR"
    assert NVLINK5.bandwidth_bytes_per_s == 900 * GB


def test_infinity_fabric_is_a_full_mesh_collectives_on_all_links_a_pair_on_one():
    assert INFINITY_FABRIC.bandwidth_bytes_per_s == 7 * 64 * GB
    assert INFINITY_FABRIC.point_to_point_bytes_per_s == 64 * GB
    megabyte = 1_000_000
    assert INFINITY_FABRIC.transfer_s(megabyte) == pytest.approx(INFINITY_FABRIC.latency_s + megabyte / (64 * GB))
    assert NVLINK5.point_to_point_bytes_per_s == NVLINK5.bandwidth_bytes_per_s  # a switch: one pair gets it all


def test_tpu_ici_per_link_from_the_chips_total():
    for name, total_gbit, links in [("tpu-v5e", 1600, 4), ("tpu-v5p", 4800, 6), ("tpu-v6e", 3584, 4)]:
        link = SYSTEMS[name].intra_link
        assert link.bandwidth_bytes_per_s == pytest.approx(total_gbit / 8 / links * GB)


def test_only_the_development_sets_devices_are_fitted():
    fitted = {name for name in SYSTEMS if efficiency_kind(get_system(name)) == "fitted"}
    # the H200 at the H100's fractions (its file's kernels_of: the same compute), and said so
    assert fitted == {"a100-nvlink", "h100-nvlink", "b200-nvlink", "gb200-nvl72", "h200-nvlink"}
    h200 = get_system("h200-nvlink")
    assert h200.device.kernels == get_system("h100-nvlink").device.kernels
    assert "published runs of the H100-SXM-80GB" in efficiency_text(h200, "fitted")
    assumed = [name for name in NEW_2026 if name not in fitted]  # no published run of them in the development set
    assert assumed and all(SYSTEMS[name].device.efficiency == DEFAULT_EFFICIENCY for name in assumed)
    assert all(efficiency_kind(get_system(name)) == "assumed" for name in assumed)  # and said so


def test_a_pipeline_inside_an_mi300x_node_sends_over_one_pairs_link():
    """The same step on a switch of the mesh's total bandwidth is faster: sends took one link."""
    workload = get_workload("transformer", {"layers": 4, "d_model": 1024, "ff": 4096, "heads": 8, "seq": 2048,
                                            "vocab": 8000})
    mesh = get_system("mi300x")
    switch = replace(mesh, intra_link=replace(INFINITY_FABRIC, pair_bandwidth_bytes_per_s=None))
    on = {name: simulate(workload, system, [2, 1, 1, 2], 32, ParallelLayout.for_partition([2, 1, 1, 2], 8)) for name, system in
          [("mesh", mesh), ("switch", switch)]}
    sends = {name: [r for r in result.timeline.records if r.kind == "send_act"] for name, result in on.items()}
    wire_s = {name: sum(r.end_s - r.start_s - INFINITY_FABRIC.latency_s for r in records)
              for name, records in sends.items()}
    assert len(sends["mesh"]) == len(sends["switch"]) == 3 * 8
    assert wire_s["mesh"] == pytest.approx(7 * wire_s["switch"], rel=1e-6)


def test_a_collective_in_a_full_mesh_uses_the_links_among_its_members():
    """Two MI300X share one 64 GB/s link, four use three each, eight use all seven; behind NVLink's
    switch every group size gets the whole link."""
    assert [INFINITY_FABRIC.collective_bytes_per_s(p) for p in (2, 4, 8)] == [64 * GB, 3 * 64 * GB, 7 * 64 * GB]
    assert {NVLINK5.collective_bytes_per_s(p) for p in (2, 4, 8, 72)} == {900 * GB}
    gigabyte = 1e9
    two, eight = (ring_allreduce_s(gigabyte, p, INFINITY_FABRIC) for p in (2, 8))
    assert two == pytest.approx(2 * 1 / 2 * gigabyte / (64 * GB) + 2 * INFINITY_FABRIC.latency_s)
    assert eight == pytest.approx(2 * 7 / 8 * gigabyte / (448 * GB) + 14 * INFINITY_FABRIC.latency_s)
