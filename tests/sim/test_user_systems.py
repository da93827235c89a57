"""A user's own system: a catalog file's copy predicts what the catalog entry does, an object over a
catalog system changes only what it names, a run's ``gpus`` cuts the nodes, and every mistake is one line."""

import copy
import json
from dataclasses import asdict

import pytest

from sim.catalog.hardware import CATALOG_FILES, SYSTEMS, get_system
from sim.catalog.kernel_model import KernelEfficiency
from sim.catalog.user_systems import catalog_name, resolve_system, run_system, system_record
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.errors import GpipeInputError
from sim.evidence.replay import replay
from sim.workloads.models import get_workload

# the torchtitan benchmark machines: H100 SXM with 96 GB of HBM2e at 2.4 TB/s
H100_96GB = {"base": "h100-nvlink", "name": "h100-96gb", "memory_gib": 96, "memory_bandwidth_tb_s": 2.4}
RUN = {"id": "small", "source": "a test", "hardware": "h100-nvlink", "nodes": 1, "model": "transformer",
       "options": {"layers": 4, "d_model": 256, "ff": 1024, "heads": 8, "seq": 128, "vocab": 1000},
       "tensor_parallel": 2, "pipeline_stages": 2, "replicas": 2, "context_parallel": 1, "virtual_stages": None,
       "microbatch_size": 2, "global_batch": 16, "checkpoint": "full", "sequence_parallel": True,
       "precision": "bf16", "measured_step_s": 0.01}


def resolve(model, options):
    return get_workload(model, options)


def write(tmp_path, data, name="cluster.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("name", list(CATALOG_FILES))
def test_a_copy_of_a_catalog_file_is_the_catalog_system(tmp_path, name):
    path = write(tmp_path, CATALOG_FILES[name])
    for nodes, fitted in ((1, True), (3, True), (2, False)):
        assert resolve_system(path, nodes, fitted=fitted) == get_system(name, nodes, fitted=fitted)
    assert resolve_system(copy.deepcopy(CATALOG_FILES[name])) == get_system(name)  # the object inline too
    assert resolve_system({"base": name}) == get_system(name)  # an override of nothing


@pytest.mark.parametrize("name", ["a100-nvlink", "h100-nvlink", "mi300x"])  # fitted, fitted, assumed
def test_a_copy_predicts_the_catalog_systems_step_and_memory(tmp_path, name):
    workload = get_workload("transformer", {"layers": 4, "d_model": 512, "ff": 2048, "heads": 8, "seq": 256,
                                            "vocab": 1000, "precision": "bf16"})
    path = write(tmp_path, CATALOG_FILES[name])
    on = [simulate(workload, system, [3, 3], 16,
                   ParallelLayout.for_partition([3, 3], 4, checkpoint="never", replicas=2), record=False)
          for system in (get_system(name, 1), resolve_system(path, 1))]
    assert on[0].step_time_s == on[1].step_time_s
    assert [s.peak_memory_bytes for s in on[0].stages] == [s.peak_memory_bytes for s in on[1].stages]


def test_an_object_over_a_catalog_system_changes_what_it_names_and_keeps_the_fitted_fractions():
    base, system = get_system("h100-nvlink"), resolve_system(H100_96GB)
    assert system.name == "h100-96gb"
    assert system.device.memory_bytes == 96 * 2**30 and system.device.memory_bandwidth_bytes_per_s == 2.4e12
    assert system.device.peak_flops == base.device.peak_flops and system.device.kernels == base.device.kernels
    assert (system.intra_link, system.inter_link, system.devices_per_node) == (base.intra_link, base.inter_link, 8)
    assert system.price_per_device_hour == base.price_per_device_hour
    assert "memory_gib: given in --hardware" in system.device.source  # an override cited as given
    assert system.device.name == "h100-96gb"  # a named variant names its device too


def test_an_unnamed_override_is_named_short_after_its_base_and_the_keys_it_changes():
    """The base's name and the changed keys (values in the description), three at most then a count;
    a key given with the base's own value changes nothing, so leaves the device's name alone."""
    system = resolve_system({"base": "h100-nvlink", "memory_gib": 96, "memory_bandwidth_tb_s": 2.4})
    assert system.name == "h100-nvlink+memory_gib+memory_bandwidth_tb_s"
    assert system.description == "8 x H100 SXM with NVLink 4, with memory_gib 96, memory_bandwidth_tb_s 2.4"
    same = resolve_system({"base": "a100-nvlink", "memory_gib": 80, "gpus_per_node": 8, "nic_gbit_s": 50})
    assert (same.name, same.device.name) == ("a100-nvlink+nic_gbit_s", "A100-SXM-80GB")
    many = resolve_system({"base": "h100-nvlink", "memory_gib": 96, "memory_bandwidth_tb_s": 2.4,
                           "peak_tflops_bf16": 900, "peak_tflops_fp8": 1800, "nic_gbit_s": 200})
    assert many.name == "h100-nvlink+memory_gib+memory_bandwidth_tb_s+peak_tflops_bf16+2 more"
    assert many.device.name == "H100-SXM-80GB+memory_gib+memory_bandwidth_tb_s+peak_tflops_bf16+1 more"


def test_an_override_takes_its_own_units_links_nics_and_sources():
    system = resolve_system({"base": "mi300x", "memory_gb": 256, "nic_gbit_s": 200, "price_per_device_hour": 1.5,
                             "sources": {"price_per_device_hour": "our contract, 2026"}})
    assert system.device.memory_bytes == 256e9 and system.inter_link.bandwidth_bytes_per_s == 25e9
    assert system.inter_link.latency_s == get_system("mi300x").inter_link.latency_s
    assert system.price_source == "our contract, 2026"
    assert system.intra_link is SYSTEMS["mi300x"].intra_link  # the catalog's Infinity Fabric mesh
    linked = resolve_system({"base": "h100-nvlink", "inter_link": "InfiniBand-HDR"})
    assert linked.inter_link.name.startswith("InfiniBand-HDR")


def test_a_whole_system_of_ones_own_is_assumed_not_fitted():
    system = resolve_system({"name": "my-gpu", "peak_tflops_bf16": 400, "memory_gb": 48,
                             "memory_bandwidth_tb_s": 1.0, "gpus_per_node": 4, "intra_link": "PCIe4-x16 (through host)",
                             "nic_gbit_s": 100, "flash_attention": True}, nodes=2)
    assert system.total_devices == 8 and system.device.kernels is None and system.device.efficiency == 0.5
    assert system.device.default_precision == "bf16" and system.intra_link.shared
    assert system.device.source == "given in --hardware" and system.price_per_device_hour is None


@pytest.mark.parametrize("data,message", [
    ({**H100_96GB, "memory_gibs": 96}, "unknown key 'memory_gibs' (did you mean memory_gib?)"),
    ({**H100_96GB, "memory_gib": "96"}, "memory_gib must be a number (memory per device in GiB), got '96'"),
    ({**H100_96GB, "gpus": 4}, "gpus is a key of the run"),
    ({**H100_96GB, "base": "h100"}, "base 'h100' is not a catalog system (did you mean h100-nvlink or h100-pcie?)"),
    ({**H100_96GB, "memory_gb": 96}, "gives both memory_gib and memory_gb; keep one"),
    ({**H100_96GB, "gpus_per_node": 0}, "gpus_per_node must be a whole number of devices"),
    ({**H100_96GB, "intra_link": "NVLink9"}, "no catalog link 'NVLink9' (did you mean NVLink1"),
    ({**H100_96GB, "intra_link": {"name": "x", "bandwidth_gb_s": 10}}, "intra_link has no 'latency_s'"),
    ({**H100_96GB, "default_precision": "fp64"}, "default_precision 'fp64' is not a precision"),
    ({**H100_96GB, "sources": {"memory": "x"}}, "sources has 'memory'"),
    ({"name": "x", "peak_tflops_bf16": 1, "memory_gb": 1, "memory_bandwidth_gb_s": 1, "intra_link": "NVLink4",
      "nic_gbit_s": 400}, "has no 'gpus_per_node'"),
    ({"name": "x", "gpus_per_node": 8, "memory_gb": 1, "memory_bandwidth_gb_s": 1, "intra_link": "NVLink4",
      "nic_gbit_s": 400}, "has no peak: give peak_tflops_bf16"),
    ([1, 2], "is not a JSON object"),
])
def test_a_malformed_system_is_one_line_naming_the_key(tmp_path, data, message):
    with pytest.raises(GpipeInputError) as raised:
        resolve_system(write(tmp_path, data))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert "hardware file" in str(raised.value)


def test_a_missing_or_broken_file_is_one_line(tmp_path):
    for ref, message in ((str(tmp_path / "none.json"), "does not exist"), (write(tmp_path, {}), "has no 'name'")):
        with pytest.raises(GpipeInputError, match=message):
            resolve_system(ref)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(GpipeInputError, match="is not valid JSON"):
        resolve_system(str(tmp_path / "bad.json"))
    with pytest.raises(GpipeInputError, match="unknown hardware 'h100'"):  # a name stays a name
        resolve_system("h100")


def test_a_plan_keeps_a_files_system_whole_and_nothing_for_a_catalog_name(tmp_path):
    path = write(tmp_path, H100_96GB)
    assert system_record("h100-nvlink") == {} and system_record(path) == {"definition": H100_96GB}
    assert catalog_name(H100_96GB) == "h100-nvlink" and catalog_name("a100-nvlink") == "a100-nvlink"


def test_a_runs_gpus_spread_over_its_nodes():
    assert run_system("gb200-nvl72", 2, 128, None, "run x").devices_per_node == 64  # two partial NVL72 racks
    assert run_system("gb200-nvl72", None, 36, None, "run x").total_devices == 36
    assert run_system("h100-nvlink", None, 32, None, "run x").nodes == 4  # null nodes: as many as gpus need
    assert run_system("b200-nvlink", 1, 8, None, "run x") == get_system("b200-nvlink")
    for nodes, gpus, message in ((1, 16, "raise nodes to 2"), (3, 20, "do not split evenly"), (1, 0, "gpus must be")):
        with pytest.raises(GpipeInputError, match=message):
            run_system("h100-nvlink", nodes, gpus, None, "run x")


def test_a_run_whose_hardware_is_an_object_is_modelled():
    by_name = replay(dict(RUN), resolve)
    same = replay({**RUN, "hardware": {"base": "h100-nvlink"}}, resolve)
    smaller = replay({**RUN, "hardware": H100_96GB}, resolve)
    assert by_name.modelled and same.modelled and smaller.modelled
    assert same.predicted_step_s == by_name.predicted_step_s
    assert smaller.predicted_step_s > by_name.predicted_step_s  # 2.4 TB/s against 3.35
    kernels = KernelEfficiency(0.5, 0.5, 0.5, 0.5, 0.5, 0.0)  # what gpipe fit-gpu tries, keyed by the base
    tried = replay({**RUN, "hardware": {"base": "h100-nvlink"}}, resolve, {"h100-nvlink": kernels})
    assert tried.predicted_step_s == replay(dict(RUN), resolve, {"h100-nvlink": kernels}).predicted_step_s


def test_a_run_with_a_malformed_hardware_object_is_not_modelled_with_one_line():
    done = replay({**RUN, "hardware": {"base": "h100-nvlink", "memory_gibs": 96}}, resolve)
    assert not done.modelled and "\n" not in done.reason
    assert done.reason.startswith("the hardware of run 'small': unknown key 'memory_gibs' (did you mean memory_gib?)")
    assert "gpus 12 do not split" in replay({**RUN, "nodes": 5, "gpus": 12}, resolve).reason


def test_a_runs_gpus_place_the_layout_on_a_partial_rack():
    """Eight GPUs of a GB200 rack: the pipeline's devices are all the rack has, one NVLink domain."""
    full = replay({**RUN, "hardware": "gb200-nvl72"}, resolve)
    partial = replay({**RUN, "hardware": "gb200-nvl72", "gpus": 8}, resolve)
    assert full.modelled and partial.modelled
    assert not replay({**RUN, "hardware": "gb200-nvl72", "gpus": 4}, resolve).modelled  # D x K x T = 8 > 4
    assert asdict(partial)["layout"]["replicas"] == 2


def test_a_device_of_the_same_silicon_is_priced_at_the_fractions_it_names():
    """The H200 is the H100 SXM's compute with more, faster memory (its catalog file's kernels_of):
    priced at the H100's fitted fractions against its own peaks and bandwidth, and a run on it says so;
    an object over it keeps them, one of its own names them, and a name that is no fitted device is one line."""
    h100, h200 = get_system("h100-nvlink").device, get_system("h200-nvlink").device
    assert h200.kernels == h100.kernels is not None and h200.name != h100.name
    assert h200.memory_bandwidth_bytes_per_s > h100.memory_bandwidth_bytes_per_s
    run = replay({**RUN, "hardware": "h200-nvlink"}, resolve)
    assert any(line.startswith("H200-SXM-141GB: kernels timed by kind at the fractions fitted for H100-SXM-80GB")
               for line in run.assumed)
    assert resolve_system({"base": "h200-nvlink", "memory_gib": 120}).device.kernels == h100.kernels
    own = {"name": "mine", "device": "X", "peak_tflops_bf16": 900, "memory_gib": 80, "memory_bandwidth_tb_s": 3,
           "gpus_per_node": 8, "intra_link": "NVLink4", "nic_gbit_s": 400}
    assert resolve_system({**own, "kernels_of": "H100-SXM-80GB"}).device.kernels == h100.kernels
    assert resolve_system(own).device.kernels is None
    with pytest.raises(GpipeInputError, match="kernels_of 'H100-SXM-80' names no device with fitted kernel "
                                              "fractions .did you mean H100-SXM-80GB"):
        resolve_system({**own, "kernels_of": "H100-SXM-80"})
