"""Plugins (tessera/plugins.py): found through their entry-point group, loaded once, a broken one skipped,
TESSERA_PLUGINS choosing which; a plugin's options become engine options and command-line flags. The
vision pipelines are the plugin Tessera ships, and nothing outside tessera/pipelines/ knows them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import plugins
from tessera.config import apply_hf_overrides, engine_option_names

ROOT = Path(__file__).resolve().parents[1]


class FakeEntryPoint:
    def __init__(self, name, function):
        self.name, self.value, self._function = name, f"fake:{name}", function

    def load(self):
        return self._function


@pytest.fixture
def fresh_plugins(monkeypatch):
    """The plugin state of a new process, with the entry points a test gives."""
    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "_option_groups", [])

    def use(*entries):
        found = lambda group: list(entries) if group == plugins.PLUGIN_GROUP else []  # noqa: E731
        monkeypatch.setattr(plugins, "entry_points", found)

    return use


def test_each_plugin_loads_once_and_a_broken_one_is_skipped(fresh_plugins, caplog, monkeypatch):
    calls = []
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    fresh_plugins(FakeEntryPoint("good", lambda: calls.append("good")),
                  FakeEntryPoint("broken", lambda: 1 / 0),
                  FakeEntryPoint("late", lambda: calls.append("late")))  # fmt: skip
    with caplog.at_level(logging.ERROR):
        plugins.load_plugins()
        plugins.load_plugins()
    assert calls == ["good", "late"]
    assert "plugin 'broken'" in caplog.text and "ZeroDivisionError" in caplog.text


@pytest.mark.parametrize("wanted, loaded", [("b", ["b"]), ("a, b", ["a", "b"]), ("", [])])
def test_tessera_plugins_names_the_plugins_loaded(fresh_plugins, monkeypatch, wanted, loaded):
    calls = []
    monkeypatch.setenv(plugins.PLUGINS_ENV, wanted)
    fresh_plugins(FakeEntryPoint("a", lambda: calls.append("a")), FakeEntryPoint("b", lambda: calls.append("b")))
    plugins.load_plugins()
    assert calls == loaded


def test_a_plugins_options_become_engine_options_and_flags(fresh_plugins, monkeypatch):
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)

    def to_engine(given):
        return {"hf_overrides": {"architectures": ["Mine"], "my_setting": given["my_setting"]}}

    def add_flags(parser):
        parser.add_argument("--my-setting", default=None)

    def from_cli(args):
        return {} if args.my_setting is None else {"my_setting": args.my_setting}

    group = plugins.OptionGroup(("my_setting",), to_engine, add_flags, from_cli)
    fresh_plugins(FakeEntryPoint("mine", lambda: plugins.register_option_group(group)))
    resolved = plugins.resolve_plugin_options({"my_setting": 3, "dtype": "float32", "hf_overrides": {"x": 1}})
    assert resolved == {"dtype": "float32", "hf_overrides": {"x": 1, "architectures": ["Mine"], "my_setting": 3}}
    assert plugins.resolve_plugin_options({"dtype": "float32"}) == {"dtype": "float32"}  # not given: untouched
    assert "my_setting" in engine_option_names()
    parser = argparse.ArgumentParser()
    plugins.add_plugin_cli_arguments(parser)
    assert plugins.plugin_options_from_cli(parser.parse_args(["--my-setting", "7"])) == {"my_setting": "7"}
    assert plugins.plugin_options_from_cli(parser.parse_args([])) == {}
    with pytest.raises(ValueError, match="already registered"):
        plugins.register_option_group(group)


def test_hf_overrides_set_keys_and_update_nested_configs_key_by_key(tiny_llava_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llava_dir)
    layers, heads = config.text_config.num_hidden_layers, config.text_config.num_attention_heads
    apply_hf_overrides(config, {"architectures": ["Other"], "text_config": {"num_hidden_layers": layers + 1}})
    assert config.architectures == ["Other"] and config.text_config.num_hidden_layers == layers + 1
    assert config.text_config.num_attention_heads == heads  # the rest of the nested config kept
    assert apply_hf_overrides(config, lambda c: "replaced") == "replaced"
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        apply_hf_overrides(config, ["architectures"])


def test_the_pipelines_plugin_is_installed_and_can_be_left_out():
    """In fresh processes: the installed entry point registers the pipeline options; TESSERA_PLUGINS=""
    leaves them out, and the options are then unknown."""
    code = ("import json; from tessera.config import engine_option_names; from tessera import ModelRegistry; "
            "print(json.dumps(['multimodal_pipeline' in engine_option_names(), "
            "'TesseraPipelineForCausalLM' in ModelRegistry.get_supported_archs()]))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != plugins.PLUGINS_ENV}
    cases = ((None, [True, True]), ("", [False, False]), ("pipelines", [True, True]))
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                 env=env if value is None else {**env, plugins.PLUGINS_ENV: value})
                for value, _ in cases]  # fmt: skip  (started together: most of each is importing torch)
    for child, (_, expected) in zip(children, cases):
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0 and json.loads(out.strip().splitlines()[-1]) == expected


def test_no_file_outside_pipelines_names_them():
    """The engine knows pipelines only as a plugin: no module, page or script of the package outside
    tessera/pipelines/ mentions them."""
    package = ROOT / "tessera"
    named = [
        str(path.relative_to(ROOT))
        for path in package.rglob("*")
        if path.is_file() and path.suffix in (".py", ".html", ".js", ".css", ".json", ".cpp", ".h")
        and package / "pipelines" not in path.parents and "pipeline" in path.read_text(errors="ignore").lower()
    ]  # fmt: skip
    assert named == []
