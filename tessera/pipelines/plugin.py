"""The pipelines as a Tessera plugin (the `tessera.plugins` entry point `pipelines` in pyproject.toml): the
pipeline model registered as an out-of-tree architecture, and the pipeline options (`multimodal_pipeline`,
`pipelines_dir`, `pipeline_params` and their flags) turned into the `hf_overrides` that select it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..models.registry import ModelRegistry
from ..plugins import OptionGroup, register_option_group

PIPELINE_ARCHITECTURE = "TesseraPipelineForCausalLM"
"""The architecture a text model's config gets (through hf_overrides) to run under a pipeline; its class,
adapter.PipelineForCausalLM, is imported when a model first needs it, so that loading the plugin stays light."""

PIPELINE_SETTINGS = "tessera_pipeline"
"""The config attribute (set through hf_overrides) with the pipeline's settings: {"name": its name, or None to
choose by the model's folder name; "pipelines_dir": a folder of extra pipeline modules, or None; "params": the
settings handed to the pipeline}."""

OPTION_NAMES = ("multimodal_pipeline", "pipelines_dir", "pipeline_params")
"""multimodal_pipeline: a pipeline's name ("auto": chosen by the model's folder name); pipelines_dir: a folder
of extra pipeline modules (each a folder with a pipelines.py); pipeline_params: settings handed to the pipeline
(vision_device, vision_bits, projector_device, projector_bits and its own, e.g. llava's vision_tower)."""


def register() -> None:
    ModelRegistry.register_model(PIPELINE_ARCHITECTURE, "tessera.pipelines.adapter:PipelineForCausalLM")
    register_option_group(OptionGroup(OPTION_NAMES, to_engine_options, add_cli_arguments, from_cli))


def to_engine_options(given: dict[str, Any]) -> dict[str, Any]:
    """The pipeline options -> hf_overrides that run the text model under the pipeline (none when neither
    a pipeline nor a pipelines folder is named)."""
    name, folder = given.get("multimodal_pipeline"), given.get("pipelines_dir")
    params = given.get("pipeline_params") or {}
    if not isinstance(params, Mapping) or not all(isinstance(key, str) for key in params):
        raise ValueError(f"pipeline_params must be a dict of setting names to values, got {params!r}.")
    if not (name or folder):
        if params:
            raise ValueError("pipeline_params need multimodal_pipeline (or pipelines_dir) to name a pipeline.")
        return {}
    settings = {"name": name, "pipelines_dir": None if folder is None else str(folder), "params": dict(params)}
    return {"hf_overrides": {"architectures": [PIPELINE_ARCHITECTURE], PIPELINE_SETTINGS: settings}}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--multimodal-pipeline", default=None, metavar="NAME",
                        help="add a vision pipeline to a text model ('auto': chosen by the model's name)")  # fmt: skip
    parser.add_argument("--pipelines-dir", default=None, metavar="DIR", help="a folder of extra pipeline modules")
    parser.add_argument("--pipeline-param", action="append", default=[], metavar="KEY=VALUE",
                        help="a pipeline setting, e.g. vision_tower=DIR or vision_bits=16 (repeatable)")  # fmt: skip


def from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline options for the flags given (none when no pipeline is named)."""
    params = {}
    for item in args.pipeline_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--pipeline-param takes KEY=VALUE, got {item!r}.")
        params[key.strip()] = value.strip()
    if not (args.multimodal_pipeline or args.pipelines_dir):
        if params:
            raise ValueError("--pipeline-param needs --multimodal-pipeline or --pipelines-dir.")
        return {}
    return {"multimodal_pipeline": args.multimodal_pipeline, "pipelines_dir": args.pipelines_dir,
            "pipeline_params": params}  # fmt: skip
