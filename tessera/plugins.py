"""Plugins: packages that extend Tessera without changing it, as vLLM's general plugins do.

A plugin is a function named in the `tessera.plugins` entry-point group of an installed package
(`[project.entry-points."tessera.plugins"] name = "package.module:register"`). `load_plugins()` calls
each once per process, before the first model lookup and before options are read, in the front-end and
in every worker or replica process alike. A plugin registers what it adds: model classes
(`ModelRegistry.register_model`, as an out-of-tree vLLM model does) and, if it has options of its own,
an `OptionGroup` that turns them into engine options (typically `hf_overrides`) and adds them to the
command line. `TESSERA_PLUGINS=a,b` loads only the plugins named (empty: none); unset, all of them.
A plugin that fails to load is logged and skipped: it must not take the engine down."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Optional

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "tessera.plugins"
PLUGINS_ENV = "TESSERA_PLUGINS"


@dataclass(frozen=True)
class OptionGroup:
    """Keyword options a plugin adds to `LLM(...)`, the engine and `tessera serve`, and their flags."""

    names: tuple[str, ...]
    """The keyword options, as `LLM(model, **options)` takes them."""

    to_engine_options: Callable[[dict[str, Any]], dict[str, Any]]
    """The group's options that were given (never empty) -> engine options (e.g. {"hf_overrides": {...}});
    raises ValueError naming what is wrong."""

    add_cli_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
    """Adds the group's flags to a `tessera generate/chat/serve` parser."""

    from_cli: Optional[Callable[[argparse.Namespace], dict[str, Any]]] = None
    """Parsed flags -> the group's keyword options (empty when none of its flags was given)."""


_option_groups: list[OptionGroup] = []
_loaded = False


def load_plugins() -> None:
    """Call every installed plugin's function once (those TESSERA_PLUGINS names, when it is set)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: a plugin that looks a model up must not load the plugins again
    wanted = os.environ.get(PLUGINS_ENV)
    allowed = None if wanted is None else {name.strip() for name in wanted.split(",") if name.strip()}
    for entry in entry_points(group=PLUGIN_GROUP):
        if allowed is not None and entry.name not in allowed:
            continue
        try:
            entry.load()()
        except Exception:  # a broken plugin is reported, the others and the engine go on
            logger.exception("The Tessera plugin %r (%s) failed to load; skipped.", entry.name, entry.value)


def register_option_group(group: OptionGroup) -> None:
    """Called by a plugin: its options become engine options, its flags command-line flags."""
    taken = {name for g in _option_groups for name in g.names}
    clash = sorted(taken & set(group.names))
    if clash:
        raise ValueError(f"The options {', '.join(clash)} are already registered by another plugin.")
    _option_groups.append(group)


def option_groups() -> tuple[OptionGroup, ...]:
    load_plugins()
    return tuple(_option_groups)


def plugin_option_names() -> set[str]:
    return {name for group in option_groups() for name in group.names}


def resolve_plugin_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with each plugin's own options replaced by the engine options they stand for; a plugin's
    `hf_overrides` are merged into those given (theirs win key by key)."""
    options = dict(options)
    for group in option_groups():
        given = {name: options.pop(name) for name in group.names if name in options}
        if not given:
            continue
        for name, value in group.to_engine_options(given).items():
            if name == "hf_overrides" and options.get(name) is not None:
                if not isinstance(options[name], dict):
                    raise ValueError(f"hf_overrides must be a dict to combine with the options {sorted(given)}.")
                value = {**options[name], **value}
            options[name] = value
    return options


def add_plugin_cli_arguments(parser: argparse.ArgumentParser) -> None:
    for group in option_groups():
        if group.add_cli_arguments is not None:
            group.add_cli_arguments(parser)


def plugin_options_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The plugins' keyword options for parsed flags (only those given)."""
    options: dict[str, Any] = {}
    for group in option_groups():
        if group.from_cli is not None:
            options.update(group.from_cli(args))
    return options
