"""The tensors of an mmproj GGUF file (llama.cpp's vision tower + projector, `tessera.gguf_mmproj`) under the
names and layouts of the Hugging Face checkpoint they were converted from, for `tessera.models.loader`.

Each tensor is de-quantized (F16, BF16, Q8_0... through the `gguf` package: the vision parts run in float, as
from a safetensors folder) and renamed by its family's table (`RENAMES`). The converters' changes are undone:
* Qwen2-VL / 2.5-VL: the Conv3d patch kernel was cut into its two frames (``v.patch_embd.weight`` and
  ``.weight.1``): stacked again on the time axis; the fused ``attn.qkv`` was split into q, k, v: joined.
* InternVL: the layer scales were written as ``ls1`` / ``ls2`` weights: ``lambda_1`` / ``lambda_2`` again.
* Pixtral (Mistral 3): the tower's q / k rows were permuted as llama.cpp's Llama's: un-permuted.
* Gemma 3: the soft-embedding norm was written as ``1 + weight`` (llama.cpp's RMSNorm multiplies by the weight
  itself): 1 is taken off.
* LLaVA (the older converter): ``mlp.fc1`` was written as ``ffn_down`` and ``fc2`` as ``ffn_up``; the roles
  are taken from the shapes (fc1 widens), as llama.cpp does. The last encoder layer and the post-layernorm,
  which LLaVA never uses, were dropped: the config's tower is as deep as the file's, and the post-layernorm
  (unused by the features) is the identity.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

import torch

from ..gguf_file import load_gguf_config
from ..gguf_mmproj import Mmproj, read_mmproj
from ..gguf_reading import gguf_reader
from ..layers.gguf_blocks import QuantizedBlocks
from .gguf import iter_gguf_checkpoint

_BLOCK = r"v\.blk\.(\d+)\."
_SIGLIP_TOWER = [  # SigLIP / CLIP towers (Gemma 3, Idefics3, LLaVA): the HF names after the tower's prefix
    (r"v\.patch_embd\.", "embeddings.patch_embedding."),
    (r"v\.position_embd\.weight", "embeddings.position_embedding.weight"),
    (r"v\.class_embd", "embeddings.class_embedding"),
    (r"v\.pre_ln\.", "pre_layrnorm."),
    (r"v\.post_ln\.", "post_layernorm."),
    (_BLOCK + r"attn_q\.", r"encoder.layers.\1.self_attn.q_proj."),
    (_BLOCK + r"attn_k\.", r"encoder.layers.\1.self_attn.k_proj."),
    (_BLOCK + r"attn_v\.", r"encoder.layers.\1.self_attn.v_proj."),
    (_BLOCK + r"attn_out\.", r"encoder.layers.\1.self_attn.out_proj."),
    (_BLOCK + r"ln1\.", r"encoder.layers.\1.layer_norm1."),
    (_BLOCK + r"ln2\.", r"encoder.layers.\1.layer_norm2."),
    (_BLOCK + r"ffn_up\.", r"encoder.layers.\1.mlp.fc1."),
    (_BLOCK + r"ffn_down\.", r"encoder.layers.\1.mlp.fc2."),
]


def _qwen_tower(v25: bool) -> list[tuple[str, str]]:
    mlp = [(_BLOCK + r"ffn_gate\.", r"blocks.\1.mlp.gate_proj."), (_BLOCK + r"ffn_up\.", r"blocks.\1.mlp.up_proj."),
           (_BLOCK + r"ffn_down\.", r"blocks.\1.mlp.down_proj.")]  # fmt: skip
    if not v25:
        mlp = [(_BLOCK + r"ffn_up\.", r"blocks.\1.mlp.fc1."), (_BLOCK + r"ffn_down\.", r"blocks.\1.mlp.fc2.")]
    return [
        (_BLOCK + r"attn_(q|k|v)\.", r"blocks.\1.attn.qkv.\2."),  # joined below: q, k, v rows in that order
        (_BLOCK + r"attn_qkv\.", r"blocks.\1.attn.qkv."),  # files written fused (--fuse-qkv)
        (_BLOCK + r"attn_out\.", r"blocks.\1.attn.proj."),
        (_BLOCK + r"ln1\.", r"blocks.\1.norm1."),
        (_BLOCK + r"ln2\.", r"blocks.\1.norm2."),
        *mlp,
        (r"v\.post_ln\.", "merger.ln_q."),
        (r"v\.patch_embd\.weight(\.1)?$", r"patch_embed.proj.weight\1"),  # joined below: the two frames
        (r"mm\.(0|2)\.", r"merger.mlp.\1."),
    ]


def _prefixed(prefix: str, table: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(pattern, prefix + replacement) for pattern, replacement in table]


RENAMES: dict[str, list[tuple[str, str]]] = {  # fmt: skip
    "qwen2vl_merger": _prefixed("model.visual.", _qwen_tower(v25=False)),
    "qwen2.5vl_merger": _prefixed("model.visual.", _qwen_tower(v25=True)),
    "gemma3": [
        *_prefixed("model.vision_tower.vision_model.", _SIGLIP_TOWER),
        (r"mm\.input_projection\.weight", "model.multi_modal_projector.mm_input_projection_weight"),
        (r"mm\.soft_emb_norm\.", "model.multi_modal_projector.mm_soft_emb_norm."),
    ],
    "idefics3": [
        *_prefixed("model.vision_model.", _SIGLIP_TOWER),
        (r"mm\.model\.fc\.", "model.connector.modality_projection.proj."),
    ],
    "internvl": [
        *_prefixed("model.vision_tower.", [
            (r"v\.class_embd", "embeddings.cls_token"),
            (r"v\.patch_embd\.", "embeddings.patch_embeddings.projection."),
            (r"v\.position_embd\.weight", "embeddings.position_embeddings"),
            (_BLOCK + r"attn_(q|k|v)\.", r"encoder.layer.\1.attention.\2_proj."),
            (_BLOCK + r"attn_(q|k)_norm\.", r"encoder.layer.\1.attention.\2_norm."),
            (_BLOCK + r"attn_out\.", r"encoder.layer.\1.attention.projection_layer."),
            (_BLOCK + r"ls(1|2)\.weight", r"encoder.layer.\1.lambda_\2"),
            (_BLOCK + r"ln1\.", r"encoder.layer.\1.layernorm_before."),
            (_BLOCK + r"ln2\.", r"encoder.layer.\1.layernorm_after."),
            (_BLOCK + r"ffn_up\.", r"encoder.layer.\1.mlp.fc1."),
            (_BLOCK + r"ffn_down\.", r"encoder.layer.\1.mlp.fc2."),
        ]),
        *_prefixed("model.multi_modal_projector.", [
            (r"mm\.model\.mlp\.0\.", "layer_norm."), (r"mm\.model\.mlp\.1\.", "linear_1."),
            (r"mm\.model\.mlp\.3\.", "linear_2."),
        ]),
    ],
    "pixtral": [
        *_prefixed("model.vision_tower.", [
            (r"v\.patch_embd\.", "patch_conv."),
            (r"v\.pre_ln\.", "ln_pre."),
            (_BLOCK + r"attn_(q|k|v)\.", r"transformer.layers.\1.attention.\2_proj."),
            (_BLOCK + r"attn_out\.", r"transformer.layers.\1.attention.o_proj."),
            (_BLOCK + r"ln1\.", r"transformer.layers.\1.attention_norm."),
            (_BLOCK + r"ln2\.", r"transformer.layers.\1.ffn_norm."),
            (_BLOCK + r"ffn_(gate|up|down)\.", r"transformer.layers.\1.feed_forward.\2_proj."),
        ]),
        *_prefixed("model.multi_modal_projector.", [
            (r"mm\.input_norm\.", "norm."), (r"mm\.patch_merger\.", "patch_merger.merging_layer."),
            (r"mm\.(1|2)\.", r"linear_\1."),
        ]),
        (r"v\.token_embd\.img_break", ""),  # the language model's embedding of [IMG_BREAK]: read from there
    ],
    "mlp": [
        *_prefixed("model.vision_tower.vision_model.", _SIGLIP_TOWER),
        (r"mm\.0\.", "model.multi_modal_projector.linear_1."),
        (r"mm\.2\.", "model.multi_modal_projector.linear_2."),
        (r"(model|v)\.image_newline", "model.image_newline"),
    ],
}
_FC = re.compile(r"(.*\.mlp\.)fc[12]\.(weight|bias)$")


LANGUAGE_MODEL_PREFIX = {"idefics3": "model.text_model."}
"""Where a VLM checkpoint keeps its language model's ``model.*`` tensors, by projector type (else
``model.language_model.``, transformers 5's layout)."""


def iter_gguf_pair(
    lm_path: Union[str, Path],
    mmproj_path: Union[str, Path],
    dtype: Optional[torch.dtype] = None,
    blocks: Optional[dict[str, QuantizedBlocks]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a GGUF pair under the VLM checkpoint's names: the language model's (de-quantized to
    `dtype`; its quantized blocks into `blocks`, as `iter_gguf_checkpoint` gives them) and the mmproj's."""
    mmproj = read_mmproj(mmproj_path, tuple(RENAMES))
    prefix = LANGUAGE_MODEL_PREFIX.get(mmproj.projector_type, "model.language_model.")

    def renamed(name: str) -> str:
        return prefix + name[len("model.") :] if name.startswith("model.") else name

    text_blocks: Optional[dict[str, QuantizedBlocks]] = {} if blocks is not None else None
    for name, tensor in iter_gguf_checkpoint(lm_path, load_gguf_config(lm_path), dtype, text_blocks):
        yield renamed(name), tensor
    if blocks is not None:
        blocks.update({renamed(name): value for name, value in text_blocks.items()})
    yield from iter_mmproj_tensors(mmproj_path, mmproj)


def iter_mmproj_tensors(
    path: Union[str, Path], mmproj: Optional[Mmproj] = None, dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, float tensor) for every tensor of the mmproj file at `path`, cast to `dtype` if given.
    A tensor no rule of its family names is an error naming it."""
    from gguf.quants import dequantize

    mmproj = mmproj or read_mmproj(path, tuple(RENAMES))
    table = [(re.compile(pattern), replacement) for pattern, replacement in RENAMES[mmproj.projector_type]]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    for tensor in gguf_reader(path).tensors:
        for pattern, replacement in table:
            if pattern.match(tensor.name):
                name = pattern.sub(replacement, tensor.name, count=1)
                break
        else:
            raise ValueError(
                f"The mmproj file {path} has a tensor {tensor.name!r} that a {mmproj.projector_type!r} projector "
                "does not have; the file is of another layout."
            )
        if not name:
            continue
        shape = [int(n) for n in reversed(tensor.shape)]
        value = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(shape)
        value = value.to(dtype) if dtype is not None else value
        if name.endswith("mm_soft_emb_norm.weight"):
            value = value - 1  # llama.cpp multiplies by the weight; Gemma's RMSNorm by 1 + weight
        if mmproj.projector_type == "pixtral" and re.search(r"attention\.(q|k)_proj\.weight$", name):
            value = _unpermuted(value, mmproj.vision("attention.head_count"))
        fc = _FC.match(name)
        if fc is not None:  # by shape: fc1 widens (the older LLaVA converter swapped their names)
            width = mmproj.vision("embedding_length")
            name = f"{fc[1]}fc{2 if value.shape[0] == width else 1}.{fc[2]}"
        seen.add(name)
        joined = _join(name, value, pending)
        if joined is not None:
            yield joined
    if pending:
        raise ValueError(f"The mmproj file {path} lacks parts of {', '.join(sorted(pending))}; the file is incomplete.")
    if mmproj.projector_type == "mlp" and not any(name.endswith("post_layernorm.weight") for name in seen):
        # the older converter drops it (LLaVA's features are taken before it): the identity stands in
        width = mmproj.vision("embedding_length")
        yield "model.vision_tower.vision_model.post_layernorm.weight", torch.ones(width, dtype=dtype)
        yield "model.vision_tower.vision_model.post_layernorm.bias", torch.zeros(width, dtype=dtype)


def _unpermuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama q / k row order (`LlamaModel.permute`: each head's rotary halves interleaved), which
    its converter also applies to Pixtral's tower."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_JOINS = [  # (HF name pattern: the joined tensor's name is head + tail, part names the piece; pieces in order; join)
    (re.compile(r"(?P<head>.*\.attn\.qkv)\.(?P<part>q|k|v)(?P<tail>\.weight|\.bias)$"), ("q", "k", "v"),
     lambda parts: torch.cat(parts, 0)),  # Qwen's fused q | k | v rows
    (re.compile(r"(?P<head>.*patch_embed\.proj\.weight)(?P<part>\.1)?(?P<tail>)$"), ("", ".1"),
     lambda parts: torch.stack(parts, 2)),  # the Conv3d kernel's two frames, on its time axis
]  # fmt: skip


def _join(name: str, value: torch.Tensor, pending: dict[str, dict[str, torch.Tensor]]):
    """(name, tensor) as it is, or None while the parts of a joined HF tensor are gathered, then the joined one."""
    for pattern, parts, join in _JOINS:
        match = pattern.match(name)
        if match is None:
            continue
        target = match["head"] + match["tail"]
        gathered = pending.setdefault(target, {})
        gathered[match["part"] or ""] = value
        if len(gathered) < len(parts):
            return None
        del pending[target]
        return target, join([gathered[p] for p in parts])
    return name, value
