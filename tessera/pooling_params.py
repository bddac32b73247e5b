"""What pooling returns and how: a model run with `runner="pooling"` maps each prompt to one vector (an embedding)
or one vector per token (multi-vector retrieval) instead of generating, as vLLM's pooling runner does.

`PoolerConfig` is the model's way of pooling the final hidden states (after the final norm):
- "LAST": the last token's (decoder embedders: GME, VLM2Vec, Qwen3-Embedding), "MEAN": the average over the
  prompt, "CLS": the first token's, "ALL": every token's (ColPali-style late interaction);
- `normalize`: divided by its L2 norm (each token's for "ALL").
A model folder saved by sentence-transformers says how in `modules.json` (a Pooling module's
`config.json`, a Normalize module); other folders pool the last token, normalized. `PoolingParams` is a request's:
`dimensions` keeps the first n features (Matryoshka embeddings), normalized after the cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


@dataclass
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")

    @classmethod
    def from_folder(cls, folder: str) -> "PoolerConfig":
        """What a sentence-transformers folder's modules.json says (its Pooling and Normalize modules); the
        defaults (last token, normalized) for any other folder."""
        modules_file = Path(folder) / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        pooling_type = "LAST"
        if "Pooling" in kinds:
            settings_file = Path(folder) / kinds["Pooling"].get("path", "") / "config.json"
            settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
            modes = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}  # fmt: skip
            chosen = [kind for key, kind in modes.items() if settings.get(key)]
            if len(chosen) != 1:
                raise ValueError(f"{settings_file} asks for {chosen or 'no'} pooling; Tessera pools one way")
            pooling_type = chosen[0]
        return cls(pooling_type, normalize="Normalize" in kinds)


@dataclass
class PoolingParams:
    """A pooling request's options (`LLM.embed`, `/v1/embeddings`)."""

    dimensions: Optional[int] = None
    """Keep the first `dimensions` features of the vector (a Matryoshka model's shorter embedding)."""

    normalize: Optional[bool] = None
    """Divide by the L2 norm; None: as the model's PoolerConfig says."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")
