"""The front door of the engine: every prompt form — text, token ids, chat messages, text with
inline `<img>` tags — becomes one `PromptInputs` (token ids, items with hashes and placeholder
ranges), checked against what the engine can hold. Chat templates are rendered here only.

It touches no engine state, so the server runs it on a worker pool while the engine keeps
stepping; the engine only queues what it returns (as vLLM's input processor feeds its engine core).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch

from ..config import ModelConfig
from ..errors import InputError
from ..multimodal.embeds import ImageEmbedsRef, decode_image_embeds_part
from ..multimodal.inline_images import inline_images_to_prompt
from ..sampling_params import SamplingParams
from .chat_utils import (
    AudioLoader,
    ContentFormat,
    ImageLoader,
    Message,
    Placeholder,
    VideoLoader,
    render_chat,
    render_plain,
)
from .core.core_io import EngineLimits
from .mistral_chat import mistral_common_tokenizer
from .prompt import PromptInputs, PromptType, longest_token_chars, process_prompt


class InputPreprocessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        processor: Any,
        limits: EngineLimits,
        *,
        chat_renderer: tuple[Any, Optional[str]] = (None, None),
        placeholder: Optional[Callable[[int], Optional[str]]] = None,
        video_placeholder: Optional[Placeholder] = None,
        audio_placeholder: Optional[Placeholder] = None,
    ) -> None:
        """`chat_renderer`: (what renders chat templates, the text an image part becomes where the
        model's template takes text only, or None); `placeholder(i)`: the model's prompt text for image i,
        if it has one;
        `video_placeholder(i)`: its text for video i, given only for a model that takes videos."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.processor = processor  # the model's BaseMultiModalProcessor, or None for a text model
        self.limits = limits
        self.renderer, self.image_text = chat_renderer
        self.chat_template: Optional[str] = getattr(self.renderer, "chat_template", None)
        self.placeholder = placeholder
        self.video_placeholder = video_placeholder
        self.audio_placeholder = audio_placeholder  # given only for a model that takes audio
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
        self.limits.check(inputs.token_ids, inputs.mm_items, params.max_tokens)
        return inputs

    def render_chat(
        self,
        messages: Sequence[Message],
        load_image: ImageLoader,
        *,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        content_format: ContentFormat = "auto",
        plain_fallback: bool = False,
        load_video: Optional[VideoLoader] = None,
        tools: Optional[list[dict]] = None,
        load_audio: Optional[AudioLoader] = None,
    ) -> dict:
        """The prompt dict for an OpenAI-style conversation through the model's chat template (or
        `chat_template`); with `plain_fallback`, a model without one gets its last message as it is.
        `load_video(url)` loads a video_url part's video; a model that takes no videos refuses them
        (InputError) before any is loaded. `tools`: OpenAI function tools for the template."""
        template = chat_template or self.chat_template
        video = self.video_loader(load_video)
        image = self._embeds_or(load_image)
        if template is None and plain_fallback and mistral_common_tokenizer(self.renderer) is None:
            prompt = render_plain(messages, image, self.placeholder, load_video=video,
                                  video_placeholder=self.video_placeholder, load_audio=self.audio_loader(load_audio),
                                  audio_placeholder=self.audio_placeholder)  # fmt: skip
        else:
            prompt = render_chat(self.renderer, template, messages, image, add_generation_prompt, self.image_text,
                                 content_format=content_format, placeholder=self.placeholder, load_video=video,
                                 video_placeholder=self.video_placeholder, tools=tools,
                                 load_audio=self.audio_loader(load_audio),
                                 audio_placeholder=self.audio_placeholder)  # fmt: skip
        return _embeds_apart(prompt)

    def decode_image_embeds(self, ref: ImageEmbedsRef) -> Any:
        """An `image_embeds` part's tensor (or dict with its grid), checked for this model (multimodal/embeds.py)."""
        hidden = self.model_config.hf_config.get_text_config().hidden_size
        return decode_image_embeds_part(ref.data, hidden, self.limits.encoder_rows)

    def _embeds_or(self, load_image: ImageLoader) -> ImageLoader:
        """`load_image`, with `image_embeds` parts decoded (the offline API takes them; the server decodes them
        itself, only when started with --enable-mm-embeds)."""
        return lambda source: self.decode_image_embeds(source) if isinstance(source, ImageEmbedsRef) else load_image(
            source
        )

    def media_io_for(
        self, media_io_kwargs: Optional[Mapping[str, Any]], mm_processor_kwargs: Optional[Mapping[str, Any]]
    ) -> Optional[dict[str, Any]]:
        """A request's media_io_kwargs, with videos decoded with their sound tracks (`with_audio`) when its
        processor kwargs, over the model's, hear them (Qwen2.5-Omni's use_audio_in_video, as vLLM names it)."""
        merged = {**self.model_config.multimodal_config.mm_processor_kwargs, **(mm_processor_kwargs or {})}
        if not (merged.get("use_audio_in_video") or merged.get("load_audio_from_video")):
            return None if media_io_kwargs is None else dict(media_io_kwargs)
        options = dict(media_io_kwargs or {})
        return {**options, "video": {**(options.get("video") or {}), "with_audio": True}}

    @property
    def takes_video(self) -> bool:
        """Whether chat messages may hold video_url parts for this model (it has a prompt text for
        videos and its chat template does not take text only)."""
        return self.video_placeholder is not None and self.image_text is None

    def video_loader(self, load_video: Optional[VideoLoader]) -> VideoLoader:
        """`load_video`, behind the check that this model takes videos (an InputError naming video
        when it does not, or when no loader is given)."""

        def load(url: str) -> Any:
            if not self.takes_video:
                name = self.model_config.hf_config.model_type
                raise InputError(f"This model ({name}) does not support video input; send images or text instead.")
            if load_video is None:
                raise InputError("Video input (a video_url part) is not supported here.")
            return load_video(url)

        return load

    def audio_loader(self, load_audio: Optional[AudioLoader]) -> AudioLoader:
        """`load_audio`, behind the check that this model takes audio (an InputError naming audio when it
        does not, or when no loader is given)."""

        def load(url: str) -> Any:
            if self.audio_placeholder is None or self.image_text is not None:
                name = self.model_config.hf_config.model_type
                raise InputError(f"This model ({name}) does not support audio input; send text instead.")
            if load_audio is None:
                raise InputError("Audio input (an input_audio or audio_url part) is not supported here.")
            return load_audio(url)

        return load

    def render_inline(self, text: str, load_image: ImageLoader) -> dict:
        """The prompt dict for text with inline `<img src=...>` tags (the model's placeholders in
        their place, the images loaded in order)."""
        return inline_images_to_prompt(text, self.placeholder, load_image)


def _embeds_apart(prompt: dict) -> dict:
    """A chat prompt whose images are all precomputed embeddings carries them as "image_embeds"; a mix of pictures
    and embeddings in one prompt is refused."""
    images = prompt.get("multi_modal_data", {}).get("image")
    tensors = [isinstance(i, dict) or (isinstance(i, torch.Tensor) and i.dim() == 2) for i in images or []]
    if not any(tensors):
        return prompt
    if not all(tensors):
        raise InputError("A prompt's images are either all image_embeds parts or all pictures; send them apart.")
    data = {k: v for k, v in prompt["multi_modal_data"].items() if k != "image"}
    return {**prompt, "multi_modal_data": {**data, "image_embeds": list(images)}}
