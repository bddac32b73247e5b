"""Finding pipeline modules (folders with a `pipelines.py`) and choosing a pipeline.

Built-in modules live in tessera/pipelines/<module>/; users add theirs by dropping a folder into
a directory given as `pipelines_dir` (`--pipelines-dir`). A module that fails to import is
reported as a warning and skipped."""

from __future__ import annotations

import importlib
import logging
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union

from .base import AbstractMultimodalPipeline

logger = logging.getLogger(__name__)
BUILTIN_DIR = Path(__file__).resolve().parent
_loaded: dict[Path, Optional[types.ModuleType]] = {}


def _import_module(folder: Path) -> Optional[types.ModuleType]:
    """`folder/pipelines.py` imported as part of a package named after the folder, so that it can
    import its siblings relatively (`from .llava import ...`); None (with a warning) if it fails."""
    if folder in _loaded:
        return _loaded[folder]
    # A package of its own per folder (named by load order: two folders may share a name).
    package = f"_tessera_pipeline_module_{len(_loaded)}_{folder.name.replace('-', '_')}"
    module = None
    try:
        stub = types.ModuleType(package)
        stub.__path__ = [str(folder)]  # type: ignore[attr-defined]
        sys.modules[package] = stub
        module = importlib.import_module(f"{package}.pipelines")
        missing = [
            a for a in ("available_pipelines", "get_pipeline", "get_pipeline_from_model_name") if not hasattr(module, a)
        ]
        if missing:
            raise AttributeError(f"pipelines.py does not define {', '.join(missing)}")
    except Exception as e:  # a broken plugin must not take the others down
        logger.warning("Skipping the pipeline module %s: %s: %s", folder, type(e).__name__, e)
        module = None
    _loaded[folder] = module
    return module


def pipeline_modules(pipelines_dir: Union[str, Path, None] = None) -> list[types.ModuleType]:
    """The importable pipeline modules: built-in ones first, then those in pipelines_dir."""
    roots = [BUILTIN_DIR] + ([Path(pipelines_dir).expanduser().resolve()] if pipelines_dir else [])
    if pipelines_dir and not roots[-1].is_dir():
        raise ValueError(f"The pipelines directory {pipelines_dir} does not exist.")
    modules = []
    for root in roots:
        for folder in sorted(p for p in root.iterdir() if (p / "pipelines.py").is_file()):
            module = _import_module(folder)
            if module is not None:
                modules.append(module)
    return modules


def list_pipelines(pipelines_dir: Union[str, Path, None] = None) -> list[str]:
    """Names of every available pipeline, built-in and from pipelines_dir."""
    return [name for module in pipeline_modules(pipelines_dir) for name in module.available_pipelines]


def load_pipeline(
    name: Optional[str] = None,
    model_name: Optional[str] = None,
    params: Optional[dict[str, Any]] = None,
    pipelines_dir: Union[str, Path, None] = None,
) -> AbstractMultimodalPipeline:
    """The pipeline called `name`, else the one a module claims for `model_name`; a clear error
    listing the available pipelines when neither gives one."""
    params = dict(params or {})
    modules = pipeline_modules(pipelines_dir)
    available = ", ".join(n for m in modules for n in m.available_pipelines) or "none"
    if name:
        for module in modules:
            pipeline = module.get_pipeline(name, params)
            if pipeline is not None:
                return pipeline
        raise ValueError(f"No multimodal pipeline named {name!r}. Available: {available}.")
    if model_name:
        for module in modules:
            pipeline = module.get_pipeline_from_model_name(model_name, params)
            if pipeline is not None:
                return pipeline
    which = f"none is known for the model name {model_name!r}" if model_name else "no model name was given"
    raise ValueError(
        f"No multimodal pipeline selected and {which}; choose one with multimodal_pipeline=NAME "
        f"(--multimodal-pipeline NAME). Available: {available}."
    )
