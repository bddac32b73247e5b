"""Gemma 3 text decoder (`model_type` "gemma3_text": Gemma3ForCausalLM, and the language model of
Gemma 3 VLMs). Module names mirror Hugging Face's.

Differences from Llama, as in transformers' modeling_gemma3.py:
- RMSNorm scales by (1 + weight), computed in float32, then cast back (`Gemma3RMSNorm`);
- `embed_tokens` multiplies by sqrt(hidden_size), cast to the embedding dtype; an `inputs_embeds`
  caller (a VLM merging image features) passes already-scaled embeddings, as in HF;
- four norms per layer: input, post_attention (on the attention output, before the residual add),
  pre_feedforward and post_feedforward (likewise around the MLP);
- per-head q_norm / k_norm before rotary; queries scaled by `query_pre_attn_scalar ** -0.5`;
- gelu_pytorch_tanh gated MLP (`hidden_activation`);
- `layer_types` (5 sliding : 1 full by default) with `sliding_window`, and two rotary embeddings:
  `rope_parameters["sliding_attention"]` (local base) and `rope_parameters["full_attention"]`;
- logits soft-capped by `final_logit_softcapping` when set; lm_head tied by default.
`attn_logit_softcapping` is read by HF's config but not applied by its Gemma 3 attention (only
Gemma 2 passes it on), so it is not applied here either.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma3TextConfig

from tessera.layers.vocab_parallel_embedding import VocabParallelEmbedding
from tessera.models.causal_lm import CausalLM, DecoderLayer, DecoderModel
from tessera.models.llama import LlamaAttention, LlamaMLP
from tessera.models.native_decode import NativeDecodeLayer, native_layer_for_step


class Gemma3RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast to the input dtype at the end."""

    unit_offset = True  # the native decode layer computes it so (native_decode.py)

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3TextScaledWordEmbedding(VocabParallelEmbedding):
    """Embeddings times sqrt(hidden_size), the scale rounded to the embedding dtype first (as HF's
    float32 buffer cast to the weight dtype: 55.4256 becomes 55.5 in bfloat16)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embed_scale, dtype=torch.float32).to(self.weight.dtype).item()
        return super().forward(input_ids) * scale


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, config: Gemma3TextConfig, rotary_emb: nn.Module, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        norm = partial(Gemma3RMSNorm, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, rotary_emb, sliding_window, qk_norm=norm, scale=config.query_pre_attn_scalar**-0.5
        )
        self.mlp = LlamaMLP(config, activation=config.hidden_activation)
        self.input_layernorm = norm(config.hidden_size)
        self.post_attention_layernorm = norm(config.hidden_size)
        self.pre_feedforward_layernorm = norm(config.hidden_size)
        self.post_feedforward_layernorm = norm(config.hidden_size)
        self._native: Optional[NativeDecodeLayer] | bool = None  # built on the first decode step; False: none

    NATIVE_NORMS = {
        "input": "input_layernorm", "post": "pre_feedforward_layernorm",
        "attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm",
    }  # fmt: skip
    """The native decode layer's norm roles (native_decode.py) -> this layer's norms."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        native = native_layer_for_step(self, hidden_states)  # decode steps, where it can
        if native is not None:
            return native(positions, hidden_states)
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out)


class Gemma3TextModel(DecoderModel):
    def __init__(self, config: Gemma3TextConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "This Gemma 3 config sets use_bidirectional_attention (an embedding model): "
                "not a causal language model."
            )
        embed_tokens = Gemma3TextScaledWordEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5)
        make_norm = partial(Gemma3RMSNorm, config.hidden_size, eps=config.rms_norm_eps)
        super().__init__(config, Gemma3DecoderLayer, "norm", make_norm, embed_tokens=embed_tokens)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__(config, Gemma3TextModel(config))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
