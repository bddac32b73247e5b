"""2-D rotary embedding of the Qwen2-VL family's vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Each patch of a [t, h, w] grid is rotated by its (row, column): the first half of the rotary
frequencies turn with the row, the second half with the column (HF's "axial" rope: frequencies over
head_dim / 2, the same table for both axes). Patches are ordered as the tower sees them: merge block
by merge block (spatial_merge_size x spatial_merge_size patches that the merger later fuses into one
token), row-major inside a block, the whole frame repeated for each of the t frames.

Matches transformers 5.x `get_vision_position_ids` + `Qwen2VLVisionRotaryEmbedding` +
`apply_rotary_pos_emb_vision` (4.x: `Qwen2VisionTransformerPretrainedModel.rot_pos_emb`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from .rotary import rotate_half

GridTHW = Union[torch.Tensor, Sequence[Sequence[int]]]


def vision_position_ids(
    grid_thw: GridTHW, spatial_merge_size: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """grid_thw [n, 3] (t, h, w per image or video) -> [N, 2] long (row, column) of every patch,
    N = sum(t * h * w), in the tower's merge-block-major order."""
    grid = torch.as_tensor(grid_thw).tolist()
    m = spatial_merge_size
    ids = []
    for t, h, w in grid:
        if h % m or w % m:
            raise ValueError(f"grid {[t, h, w]}: h and w must be multiples of spatial_merge_size {m}")
        rows, cols = torch.meshgrid(
            torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
        )  # [h, w] each
        block = (h // m, m, w // m, m)  # -> (block row, block column, row in block, column in block)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        ids.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))  # [t * h * w, 2]
    if not ids:
        return torch.zeros(0, 2, dtype=torch.long, device=device)
    return torch.cat(ids)


class VisionRotaryEmbedding(nn.Module):
    """rot_pos_emb(grid_thw) -> angles [N, head_dim / 2]; forward(grid_thw) -> (cos, sin), each
    [N, head_dim] fp32, for `apply_rotary_pos_emb_vision`. Position ids only depend on grid_thw, so
    a tower computes cos/sin once per forward and shares them between its blocks."""

    def __init__(self, head_dim: int, theta: float = 10000.0, spatial_merge_size: int = 2) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rope needs head_dim divisible by 4 (two axes x cos/sin pairs), got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.spatial_merge_size = spatial_merge_size
        spatial_dim = head_dim // 2  # each axis gets half the rotary features
        # CPU explicitly: towers are built under `with torch.device("meta")`; HF's table, moved on use
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float, device="cpu") / spatial_dim
        self._inv_freq = {torch.device("cpu"): 1.0 / (self.theta**exponents)}  # [head_dim / 4]

    @classmethod
    def from_config(cls, vision_config: Any) -> "VisionRotaryEmbedding":
        """From an HF vision config: Qwen2-VL's `embed_dim` (its `hidden_size` is the LLM's),
        else `hidden_size` (Qwen2.5-VL, Qwen3-VL), over `num_heads`; rope_theta if it has one."""
        head_dim = getattr(vision_config, "head_dim", None)
        if not head_dim:
            width = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
            head_dim = width // vision_config.num_heads
        params = getattr(vision_config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") or getattr(vision_config, "rope_theta", None) or 10000.0
        return cls(head_dim, theta, vision_config.spatial_merge_size)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    def rot_pos_emb(self, grid_thw: GridTHW, device: Optional[torch.device] = None) -> torch.Tensor:
        """grid_thw [n, 3] -> angles [N, head_dim / 2]: row angles then column angles."""
        device = device or (grid_thw.device if isinstance(grid_thw, torch.Tensor) else torch.device("cpu"))
        ids = vision_position_ids(grid_thw, self.spatial_merge_size, device)  # [N, 2]
        freqs = ids[..., None].float() * self.inv_freq(device)  # [N, 2, head_dim / 4]
        return freqs.flatten(1)  # [N, head_dim / 2]

    def forward(self, grid_thw: GridTHW, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """grid_thw [n, 3] -> (cos, sin), each [N, head_dim] fp32."""
        emb = self.rot_pos_emb(grid_thw, device).repeat(1, 2)  # [N, head_dim]: both halves share an angle
        return emb.cos(), emb.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, spatial_merge_size={self.spatial_merge_size}"


def apply_rotary_pos_emb_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, heads, head_dim], k [N, heads, head_dim]; cos, sin [N, head_dim] -> rotated q, k.
    Computed in fp32 and cast back, as HF does (vision towers often run in bf16)."""
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()  # [N, 1, head_dim]
    q_out = q.float() * cos + rotate_half(q.float()) * sin
    k_out = k.float() * cos + rotate_half(k.float()) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
