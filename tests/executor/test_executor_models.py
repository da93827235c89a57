import pytest
import torch
from torch import nn

from executor.models.build import build_model, default_loss, example_batch, loss_function, model_ref
from sim.errors import GpipeInputError
from sim.workloads.model_defaults import DEFAULT_OPTIONS


@pytest.mark.parametrize("name,layers", [("mlp", 8), ("transformer", 6), ("cnn", 6)])
def test_builtins_have_the_documented_layer_count(name, layers):
    model = build_model(name, {}, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) == layers
    ref = model_ref(name, {})
    assert ref.num_layers == layers
    assert ref.parameter_count == sum(p.numel() for p in model.parameters())
    assert ref.options == DEFAULT_OPTIONS[name]


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_same_seed_same_weights_and_data_and_output_shapes(name):
    a, b = build_model(name, {}, seed=3), build_model(name, {}, seed=3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(next(build_model(name, {}, seed=4).parameters()), next(a.parameters()))
    x, y = example_batch(name, {}, 5, seed=1)
    x2, y2 = example_batch(name, {}, 5, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    loss = loss_function(default_loss(name))(a(x), y)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_transformer_is_causal():
    model = build_model("transformer", {"layers": 2, "seq": 8}, seed=0).eval()
    x, _ = example_batch("transformer", {"seq": 8}, 1, seed=0)
    changed = x.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    out, out2 = model(x), model(changed)
    torch.testing.assert_close(out[0, :5], out2[0, :5])
    assert not torch.allclose(out[0, 5:], out2[0, 5:])


def test_cnn_has_batch_norm_after_the_stem_conv():
    model = build_model("cnn", {}, seed=0)
    assert isinstance(model[0][1], nn.BatchNorm2d)


def test_unknown_model_and_option_fail_with_one_line():
    with pytest.raises(GpipeInputError, match="unknown model 'resnet'"):
        build_model("resnet", {})
    with pytest.raises(GpipeInputError, match="no option 'depth'"):
        build_model("mlp", {"depth": 3})
    with pytest.raises(GpipeInputError, match="cannot import"):
        build_model("no_such_pkg.models:build", {})


@pytest.mark.parametrize("name,options,message", [
    ("mlp", {"width": -5}, "width=-5 for model mlp; use a positive integer"),
    ("transformer", {"d_model": "-4"}, "d_model=-4 for model transformer; use a positive integer"),
    ("transformer", {"heads": 3}, "heads=3 does not divide d_model=64; choose heads that divide d_model"),
    ("transformer", {"dropout": 1.5}, "dropout=1.5 for model transformer; use a number in [0, 1)"),
    ("cnn", {"channels": 0}, "channels=0 for model cnn; use a positive integer"),
])
def test_a_built_in_models_values_are_checked_as_the_simulator_checks_them(name, options, message):
    """One line, as ``gpipe simulate`` gives, where the build used to fail inside torch (a negative
    dimension) or at the first forward (heads that do not divide d_model)."""
    with pytest.raises(GpipeInputError) as error:
        build_model(name, options)
    assert str(error.value) == message


def test_user_factory_and_its_example_batch(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build(width=4):\n    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))\n"
        "def not_sequential():\n    return nn.Linear(2, 2)\n"
        "def example_batch(rows):\n    return torch.randn(rows, 4), torch.randn(rows, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_ref("user_models:build", {}).num_layers == 3
    x, y = example_batch("user_models:build", {}, 6, seed=2)
    assert x.shape == (6, 4) and torch.equal(x, example_batch("user_models:build", {}, 6, seed=2)[0])
    with pytest.raises(GpipeInputError, match="must return an nn.Sequential"):
        build_model("user_models:not_sequential", {})
