"""Chats for models whose chat format is mistral-common's code, not a Jinja template (Voxtral's tekken.json,
read by transformers' MistralCommonBackend).

mistral-common writes the special tokens and each recording's `[BEGIN_AUDIO][AUDIO]...` itself, and text cannot
carry them back (Tekken encodes `[INST]` in text as plain characters), so such a chat becomes token ids, as
HF's `apply_chat_template(tokenize=True)` makes them, with the recordings as mistral-common prepared them
(resampled, padded to whole chunks): the same ids and audio HF's processor gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ..errors import InputError


def mistral_common_tokenizer(renderer: Any) -> Optional[Any]:
    """The MistralCommonBackend behind `renderer` (a processor or a tokenizer), if it is one."""
    tokenizer = getattr(renderer, "tokenizer", renderer)
    return tokenizer if type(tokenizer).__name__ == "MistralCommonBackend" else None


def render_mistral_chat(
    tokenizer: Any,
    hf_messages: list[dict],
    media: dict[str, Sequence[Any]],
    uuids: dict[str, Optional[Sequence[Optional[str]]]],
    add_generation_prompt: bool = True,
    tools: Optional[list[dict]] = None,
) -> dict:
    """The engine prompt ({"prompt_token_ids", "multi_modal_data"}) for parsed messages and their loaded
    recordings ((waveform, rate) pairs, in order)."""
    from mistral_common.tokens.tokenizers.audio import Audio

    if media.get("image") or media.get("video"):
        raise InputError("This model takes text and audio only; send no image or video parts.")
    audios = iter(media.get("audio", ()))
    messages = []
    for message in hf_messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "audio":
                    waveform, rate = next(audios)
                    data = Audio(audio_array=waveform, sampling_rate=int(rate), format="wav").to_base64("wav")
                    parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
                elif part.get("text"):
                    parts.append({"type": "text", "text": part["text"]})
            content = parts
        messages.append({**message, "content": content})
    final = not add_generation_prompt and bool(messages) and messages[-1]["role"] == "assistant"
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, return_dict=True, continue_final_message=final
        )
    except (ValueError, AssertionError, TypeError) as e:  # mistral-common's validation of the conversation
        raise InputError(f"The conversation cannot be encoded for this model: {e}") from None
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    recordings = list(encoded.get("audio") or [])
    if recordings:
        rate = tokenizer.tokenizer.instruct_tokenizer.audio_encoder.audio_config.sampling_rate
        prompt["multi_modal_data"] = {"audio": [(recording, rate) for recording in recordings]}
        named = uuids.get("audio")
        if named is not None and any(uuid is not None for uuid in named):
            prompt["multi_modal_uuids"] = {"audio": list(named)}
    return prompt
