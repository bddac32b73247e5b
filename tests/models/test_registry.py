"""ModelRegistry: architecture names -> model classes."""

from __future__ import annotations

import pytest

from tessera import ModelRegistry
from tessera.models.interfaces import supports_multimodal


def test_builtin_architectures_resolve_lazily_to_multimodal_classes():
    for arch in ("LlavaForConditionalGeneration", "FuyuForCausalLM"):
        model_cls, resolved = ModelRegistry.resolve_model_cls(["SomethingElse", arch])
        assert resolved == arch and model_cls.__name__ == arch
        assert supports_multimodal(model_cls)


def test_register_model_by_class_and_by_import_string():
    class Plugin:
        pass

    ModelRegistry.register_model("TestPluginByClass", Plugin)
    ModelRegistry.register_model("TestPluginByString", "collections:OrderedDict")
    assert ModelRegistry.resolve_model_cls(["TestPluginByClass"]) == (Plugin, "TestPluginByClass")
    from collections import OrderedDict

    assert ModelRegistry.resolve_model_cls(["TestPluginByString"])[0] is OrderedDict
    assert {"TestPluginByClass", "TestPluginByString"} <= set(ModelRegistry.get_supported_archs())


@pytest.mark.parametrize("bad", ["no_colon_here", 42])
def test_register_model_rejects_bad_classes(bad):
    with pytest.raises(ValueError, match="must be a class or a 'module.path:ClassName'"):
        ModelRegistry.register_model("TestBad", bad)


def test_unknown_architecture_explains_how_to_register():
    with pytest.raises(ValueError, match="register_model"):
        ModelRegistry.resolve_model_cls(["Unknown"])
