"""The front door of the engine: every prompt form becomes one `PromptInputs` (token ids, items
with hashes and placeholder ranges), checked against what the engine can hold.

It touches no engine state, so the server runs it on a worker pool while the engine keeps
stepping; the engine only queues what it returns (as vLLM's input processor feeds its engine core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from ..config import ModelConfig
from ..errors import InputError
from ..sampling_params import SamplingParams
from .prompt import PromptInputs, PromptType, longest_token_chars, process_prompt


@dataclass(frozen=True)
class EngineLimits:
    """What one request may use of the engine."""

    max_model_len: int
    encoder_rows: int  # the most encoder rows one item may need (encoder budget and cache)
    kv_tokens: int  # tokens the whole KV cache holds


class InputPreprocessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, processor: Any, limits: EngineLimits) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.processor = processor  # the model's BaseMultiModalProcessor, or None for a text model
        self.limits = limits
        text_config = model_config.hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size  # token ids a prompt may hold: rows of the embedding table
        # No text longer than this can fit the context (every token covers at most this many
        # characters): refused before tokenizing, which is slow for megabytes.
        self.max_prompt_chars = limits.max_model_len * longest_token_chars(tokenizer)

    def process(self, prompt: Union[PromptType, PromptInputs], params: SamplingParams) -> PromptInputs:
        """A prompt as engine inputs (unchanged if already processed). Bad input raises InputError."""
        inputs = (
            prompt if isinstance(prompt, PromptInputs) else process_prompt(self, prompt, params.truncate_prompt_tokens)
        )
        self._check_fits(inputs, params)
        return inputs

    def _check_fits(self, inputs: PromptInputs, params: SamplingParams) -> None:
        limits, num_tokens = self.limits, len(inputs.token_ids)
        if num_tokens >= limits.max_model_len:
            raise InputError(
                f"The prompt has {num_tokens} tokens but the model's context is {limits.max_model_len}; "
                "shorten it or set truncate_prompt_tokens."
            )
        if num_tokens == 0:
            raise InputError("The prompt is empty.")
        for item in inputs.mm_items:
            if item.num_embeds > limits.encoder_rows:
                raise InputError(
                    f"A {item.modality} needs {item.num_embeds} encoder rows but the encoder budget is "
                    f"{limits.encoder_rows}; raise max_num_encoder_input_tokens / encoder_cache_size or send a "
                    "smaller item."
                )
        needed = min(num_tokens + (params.max_tokens or limits.max_model_len), limits.max_model_len)
        if needed > limits.kv_tokens:
            raise InputError(
                f"This request may need {needed} tokens of KV cache but it holds {limits.kv_tokens}; "
                "raise kv_cache_memory or lower max_tokens."
            )
