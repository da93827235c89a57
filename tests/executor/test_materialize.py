"""``--init meta``: models built on the meta device, each stage materialising its own layers; and
``--init-from``."""

import json
import struct

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_meta_model, build_model
from executor.models.materialize import materialise
from executor.runtime.pipeline import LocalPipeline, prepare
from sim.errors import GpipeInputError

TRANSFORMER = {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64}


def params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("partition", [(4,), (2, 2), (1, 2, 1), (1, 1, 1, 1)])
def test_every_k_starts_from_the_same_parameters(partition):
    config = RunConfig.of(model="transformer", options=TRANSFORMER, partition=partition, batch_size=4, microbatches=2,
                       init="meta")
    pipelined = params(LocalPipeline(config).model())
    meta = build_meta_model("transformer", TRANSFORMER)
    whole = params(torch.nn.Sequential(*materialise(meta, range(len(meta)), 0)))
    assert pipelined.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(pipelined[name], value), name


def test_values_are_a_function_of_seed_and_layer_only():
    meta = build_meta_model("mlp", {"layers": 4, "width": 8})
    alone = materialise(meta, [2], seed=3)[0]
    together = materialise(meta, [0, 1, 2, 3], seed=3)
    assert torch.equal(alone[0].weight, together[2][0].weight)
    assert not torch.equal(alone[0].weight, materialise(meta, [2], seed=4)[0][0].weight)
    assert not torch.equal(together[1][0].weight, together[2][0].weight)  # each layer its own stream


def test_preparing_a_model_larger_than_memory_allocates_nothing():
    # 64 layers of 16384 x 16384: 69 GB of fp32 weights, more than this machine holds
    config = RunConfig.of(model="mlp", options={"layers": 64, "width": 16384}, partition=(32, 32), batch_size=4,
                       microbatches=2)
    prepared = prepare(config)
    assert all(p.device.type == "meta" for p in prepared.model.parameters())
    assert sum(p.numel() for p in prepared.model.parameters()) * 4 > 60e9


BAD = '''
import torch
from torch import nn

class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
    def forward(self, x):
        return x * self.gain

def net():
    return nn.Sequential(nn.Linear(4, 4), Scale())

def example_batch(rows):
    return torch.randn(rows, 4), torch.randn(rows, 4)
'''


def test_under_init_meta_a_parameter_nothing_can_initialise_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "no_reset.py").write_text(BAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GpipeInputError) as info:
        prepare(RunConfig.of(model="no_reset:net", partition=(1, 1), batch_size=4, microbatches=2, init="meta"))
    assert "'gain' of Scale in layer 1 (Scale) has no reset_parameters()" in str(info.value)
    assert "\n" not in str(info.value)
    pipe = LocalPipeline(RunConfig.of(model="no_reset:net", partition=(1, 1), batch_size=4, microbatches=2))
    assert torch.equal(pipe.model()[1].gain, torch.ones(4))  # the default keeps the constructor's value


# ----------------------------------------------------------------------------- --init-from


def write_safetensors(path, tensors):
    """A minimal safetensors writer (the format: u64 header size, JSON header, raw bytes)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.dim() else b""
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize("kind", ["pt", "safetensors", "folder"])
def test_init_from_loads_every_stage_from_one_file(tmp_path, kind):
    source = build_model("transformer", TRANSFORMER, seed=7).state_dict()
    if kind == "pt":
        path = tmp_path / "weights.pt"
        torch.save(source, path)
    else:
        path = tmp_path / ("weights.safetensors" if kind == "safetensors" else "model.safetensors")
        write_safetensors(path, {k: v.to(torch.bfloat16) if k.endswith("weight") else v for k, v in source.items()})
        path = tmp_path if kind == "folder" else path
    config = RunConfig.of(model="transformer", options=TRANSFORMER, partition=(1, 2, 1), batch_size=4, microbatches=2,
                       init_from=str(path))
    loaded = params(LocalPipeline(config).model())
    for name, value in source.items():
        expected = value.to(torch.bfloat16).float() if kind != "pt" and name.endswith("weight") else value
        assert torch.equal(loaded[name], expected), name


def test_a_tied_weight_stored_once_reaches_every_copy(tmp_path):
    source = build_model("tests.helpers.sample_models:tied_lm", {}, seed=5).state_dict()
    del source["3.weight"]  # stored once, under the embedding's name, as Hugging Face files do
    torch.save(source, tmp_path / "tied.pt")
    pipe = LocalPipeline(RunConfig.of(model="tests.helpers.sample_models:tied_lm", data="tests.helpers.sample_models:tied_lm_data",
                                   loss="cross_entropy", partition=(2, 2), batch_size=4, microbatches=2,
                                   init_from=str(tmp_path / "tied.pt")))
    layers = list(pipe.model())
    assert torch.equal(layers[0].embedding.weight, source["0.embedding.weight"])
    assert torch.equal(layers[3].weight, source["0.embedding.weight"])


@pytest.mark.parametrize("change,message", [
    (lambda s: s.pop("1.mlp.0.weight"), "has no tensor '1.mlp.0.weight'"),
    (lambda s: s.update({"0.token.weight": torch.zeros(3, 3)}), "'0.token.weight' has shape [3, 3] but the model's"),
])
def test_init_from_that_does_not_match_is_one_line(tmp_path, change, message):
    source = build_model("transformer", TRANSFORMER).state_dict()
    change(source)
    torch.save(source, tmp_path / "w.pt")
    with pytest.raises(GpipeInputError) as info:
        prepare(RunConfig.of(model="transformer", options=TRANSFORMER, partition=(2, 2), batch_size=4,
                          microbatches=2, init_from=str(tmp_path / "w.pt")))
    assert message in str(info.value) and "\n" not in str(info.value)
