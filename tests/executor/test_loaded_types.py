"""isinstance against a class of a module that may never have been imported (executor.models.loaded_types)."""

from __future__ import annotations

import sys
import types

import torch


def test_a_class_whose_module_was_never_imported_has_no_instances_and_is_not_imported(monkeypatch):
    from executor.models.loaded_types import is_dtensor, is_loaded_instance, is_zero_optimizer

    assert not is_loaded_instance(object(), "gpipe_module_never_imported", "Thing")
    assert "gpipe_module_never_imported" not in sys.modules
    module = types.ModuleType("gpipe_loaded_module")

    class Thing:
        pass

    module.Thing = Thing
    monkeypatch.setitem(sys.modules, "gpipe_loaded_module", module)
    assert is_loaded_instance(Thing(), "gpipe_loaded_module", "Thing")
    assert not is_loaded_instance(object(), "gpipe_loaded_module", "Thing")
    import torch.distributed.optim  # noqa: F401  loaded: the ordinary isinstance
    import torch.distributed.tensor  # noqa: F401

    assert not is_dtensor(torch.zeros(2)) and not is_zero_optimizer(torch.optim.SGD([torch.zeros(2)], lr=0.1))
