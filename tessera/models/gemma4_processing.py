"""Gemma 4's multimodal processing, as transformers 5.23's Gemma4Processor expands a prompt:
- `<|image|>` -> boi + n `<|image|>` + eoi, n = the image's patches after an aspect-preserving resize to at most
  max_soft_tokens * k^2 patches (sides multiples of k * patch), divided by k^2 (k: pooling_kernel_size);
- `<|video|>` -> per sampled frame "MM:SS " + boi + n `<|video|>` + eoi, the frames joined by spaces (n: the
  frame's soft tokens, as an image's; MM:SS the frame's time: frame index / fps, 24 fps when unknown);
- `<|audio|>` -> boa + n `<|audio|>` + eoa, n the valid mel frames left after two stride-2 convolutions.
The processor tokenizes the expanded text, so a frame's timestamp is tokenized with the text around it. As for
Gemma 3's crops (gemma3_mm.py), we write each video's first timestamp into the prompt before its `<|video|>`,
tokenize the prompt apart from the items, and place the items ourselves: the text between two frames lies
between special tokens and tokenizes alone, so the tokens are HF's. Only the soft tokens take embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from transformers import BatchFeature, Gemma4Config, Gemma4Processor
from transformers.video_utils import VideoMetadata

from tessera.errors import InputError
from tessera.models.gemma4_audio import num_audio_tokens
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import MultiModalDataItems, MultiModalDataParser, VideoProcessorItems, bare_video_metadata
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder

IMAGE, VIDEO, AUDIO = "<|image|>", "<|video|>", "<|audio|>"
DEFAULT_FPS = 24  # what Gemma4Processor assumes for frames without a frame rate


def frame_time(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4ProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Gemma4Config:
        return self.ctx.get_hf_config(Gemma4Config)

    def get_hf_processor(self, **kwargs: object) -> Gemma4Processor:
        return self.ctx.get_hf_processor(Gemma4Processor, **kwargs)

    def get_feature_extractor(self) -> Any:
        return self.get_hf_processor().feature_extractor

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        config = self.get_hf_config()
        limits: dict[str, Optional[int]] = {}
        if config.vision_config is not None:
            limits.update(image=None, video=None)
        if config.audio_config is not None:
            limits["audio"] = None
        return limits

    def vision_settings(self, modality: str, mm_kwargs: Mapping[str, object] = {}) -> dict[str, Any]:
        """patch_size, pooling_kernel_size, max_soft_tokens (and for videos the frame sampling) of a call."""
        processor = self.get_hf_processor()
        sub = processor.image_processor if modality == "image" else processor.video_processor
        keys = ["patch_size", "pooling_kernel_size", "max_soft_tokens"]
        if modality == "video":
            keys += ["do_sample_frames", "num_frames", "fps"]
        return self.ctx.get_call_settings(keys, {key: getattr(sub, key, None) for key in keys}, mm_kwargs)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """Placeholders with their begin/end tokens (and a video's timestamps: at most 8 tokens a frame)."""
        tokens = {}
        if "image" in self.get_supported_mm_limits():
            tokens["image"] = int(self.vision_settings("image")["max_soft_tokens"]) + 2
            video = self.vision_settings("video")
            tokens["video"] = int(video["num_frames"] or 1) * (int(video["max_soft_tokens"]) + 2 + 8)
        if "audio" in self.get_supported_mm_limits():
            tokens["audio"] = int(self.get_hf_processor().audio_seq_length) + 2
        return tokens


class Gemma4DummyInputsBuilder(BaseDummyInputsBuilder[Gemma4ProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE * mm_counts.get("image", 0) + VIDEO * mm_counts.get("video", 0) + AUDIO * mm_counts.get("audio", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        """Square black pictures big enough for the most soft tokens, and the longest audio (the processor's
        audio_seq_length tokens of audio_ms_per_token each: 30 s as released)."""
        side = 16 * 3 * 64
        data: dict[str, object] = {}
        if mm_counts.get("image", 0):
            data["image"] = self._get_dummy_images(width=side, height=side, num_images=mm_counts["image"])
        if mm_counts.get("video", 0):
            frames = int(self.info.vision_settings("video")["num_frames"] or 1)
            data["video"] = [np.zeros((frames, 480, 480, 3), dtype=np.uint8)] * mm_counts["video"]
        if mm_counts.get("audio", 0):
            processor = self.info.get_hf_processor()
            seconds = processor.audio_seq_length * processor.audio_ms_per_token / 1000
            samples = int(seconds * processor.feature_extractor.sampling_rate)
            data["audio"] = [np.zeros(samples, dtype=np.float32)] * mm_counts["audio"]
        return data


class Gemma4MultiModalProcessor(BaseMultiModalProcessor[Gemma4ProcessingInfo]):
    def _get_data_parser(self) -> MultiModalDataParser:
        has_audio = self.info.get_hf_config().audio_config is not None
        return MultiModalDataParser(target_sr=self.info.get_feature_extractor().sampling_rate if has_audio else None)

    def apply(self, prompt, mm_data, hf_processor_mm_kwargs: Mapping[str, object] = {}, *, mm_uuids=None):
        """Write each video's first timestamp before its `<|video|>` (see the module docstring), then process."""
        mm_items = self._to_mm_items(mm_data, hf_processor_mm_kwargs)
        if "video" in mm_items and mm_items["video"].get_count():
            count = mm_items["video"].get_count()
            prompt = self._write_first_times(prompt, [self._frame_times(mm_items, i, hf_processor_mm_kwargs)[0]
                                                      for i in range(count)])  # fmt: skip
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    def _write_first_times(self, prompt: Any, times: list[str]) -> Any:
        if isinstance(prompt, str):
            parts = prompt.split(VIDEO)
            return parts[0] + "".join(
                (f"{times[i]} " if i < len(times) else "") + VIDEO + part for i, part in enumerate(parts[1:])
            )
        video_id, tokenizer, out, count = self.info.get_hf_config().video_token_id, self.info.get_tokenizer(), [], 0
        for token in prompt:
            if token == video_id and count < len(times):
                out += tokenizer.encode(f"{times[count]} ", add_special_tokens=False)
                count += 1
            out.append(token)
        return out

    def _frame_times(self, mm_items: MultiModalDataItems, index: int, mm_kwargs: Mapping[str, object]) -> list[str]:
        """MM:SS of each frame of video `index` the HF processor keeps (sampled again if its settings say so)."""
        videos = mm_items.get_items("video", VideoProcessorItems)
        metadata = VideoMetadata(**(videos.get_metadata(index) or bare_video_metadata(videos.get(index))))
        settings = self.info.vision_settings("video", mm_kwargs)
        if settings["do_sample_frames"]:
            video_processor = self.info.get_hf_processor().video_processor
            indices = video_processor.sample_frames(metadata, num_frames=settings["num_frames"], fps=settings["fps"])
            metadata.frames_indices = [metadata.frames_indices[int(i)] for i in indices]
        fps = metadata.fps or DEFAULT_FPS
        return [frame_time(i / fps) for i in metadata.frames_indices]

    def _apply_hf_processor_main(
        self, prompt, mm_items: MultiModalDataItems, hf_processor_mm_kwargs, *, enable_hf_prompt_update: bool
    ):
        """The text tokenized apart from the items, which are placed by us (see the module docstring)."""
        return super()._apply_hf_processor_main(prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=False)

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """The HF processor takes `audio` (not `audios`)."""
        data = dict(mm_data)
        if data.get("audios"):
            data["audio"] = list(data.pop("audios"))
        return super()._call_hf_processor(prompt, data, mm_kwargs)

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        frames = torch.as_tensor(hf_inputs.get("num_frames_per_video", torch.empty(0, dtype=torch.long)))
        return dict(
            pixel_values=MultiModalFieldConfig.batched("image"),
            image_position_ids=MultiModalFieldConfig.batched("image"),
            pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", frames),
            video_position_ids=MultiModalFieldConfig.flat_from_sizes("video", frames),
            num_frames_per_video=MultiModalFieldConfig.batched("video"),
            input_features=MultiModalFieldConfig.batched("audio"),
            input_features_mask=MultiModalFieldConfig.batched("audio"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        config, tokenizer = self.info.get_hf_config(), self.info.get_tokenizer()
        kernel_area = config.vision_config.pooling_kernel_size**2 if config.vision_config is not None else 1

        def items(modality: str) -> list:
            return out_mm_kwargs.get_items(modality) if out_mm_kwargs.get_item_count(modality) else []

        def soft_tokens(positions: Any) -> list[int]:  # per picture: its real (not padding) patches / k^2
            valid = (torch.as_tensor(positions.data).reshape(-1, positions.data.shape[-2], 2) != -1).all(-1)
            return (valid.sum(-1) // kernel_area).tolist()

        def image(i: int) -> PromptUpdateDetails:
            (n,) = soft_tokens(items("image")[i]["image_position_ids"])
            tokens = [config.boi_token_id, *[config.image_token_id] * n, config.eoi_token_id]
            return PromptUpdateDetails.select_token_id(tokens, config.image_token_id)

        def video(i: int) -> PromptUpdateDetails:
            times = self._frame_times(mm_items, i, hf_processor_mm_kwargs)
            tokens: list[int] = []
            for frame, n in enumerate(soft_tokens(items("video")[i]["video_position_ids"])):
                if frame:  # the first frame's time is in the prompt already
                    tokens += tokenizer.encode(f" {times[frame]} ", add_special_tokens=False)
                tokens += [config.boi_token_id, *[config.video_token_id] * n, config.eoi_token_id]
            return PromptUpdateDetails.select_token_id(tokens, config.video_token_id)

        most = self.info.get_hf_processor().audio_seq_length if "audio" in mm_items else 0

        def audio(i: int) -> PromptUpdateDetails:
            n = num_audio_tokens(int(torch.as_tensor(items("audio")[i]["input_features_mask"].data).sum()))
            if n > most:  # what the engine plans for (the processor's cap; the feature extractor cuts at 30 s)
                raise InputError(f"An audio clip gives {n} soft tokens, more than this model's processor takes "
                                 f"({most}, audio_seq_length); send a shorter clip.")  # fmt: skip
            tokens = [config.boa_token_id, *[config.audio_token_id] * n, config.eoa_token_index]
            return PromptUpdateDetails.select_token_id(tokens, config.audio_token_id)

        return [
            PromptReplacement(modality="image", target=[config.image_token_id], replacement=image),
            PromptReplacement(modality="video", target=[config.video_token_id], replacement=video),
            PromptReplacement(modality="audio", target=[config.audio_token_id], replacement=audio),
        ]
