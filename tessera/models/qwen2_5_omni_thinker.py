"""Qwen2.5-Omni's thinker: audio, images and video in, text out (the talker, which speaks, is not run). Its audio
encoder reads 2-second windows (qwen2_5_omni_audio.py), its vision tower is Qwen2.5-VL's with q, k, v apart, its
decoder Qwen2 with time-aligned M-RoPE (qwen2_5_omni_positions.py). As transformers' Qwen2.5-Omni thinker;
processing as vLLM's qwen2_5_omni_thinker.py.

The HF processor expands `<|AUDIO|>` to 25 tokens a second, `<|IMAGE|>` / `<|VIDEO|>` to one token per merged
patch. With `use_audio_in_video` (vLLM's mm_processor_kwargs; the prompt has video placeholders only), audio item i
is video i's sound track: the video becomes one item whose `<|VIDEO|>` expands to `<|audio_bos|>`, its frames'
and its audio's tokens interleaved in 2-second chunks, `<|audio_eos|>`; its embeddings come in that order.
Checkpoints: the thinker alone (`Qwen2_5OmniThinkerForConditionalGeneration`) or the whole model
(`Qwen2_5OmniForConditionalGeneration`, formerly `Qwen2_5OmniModel`: `thinker.*` read, `talker.*` and
`token2wav.*` skipped).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from transformers import BatchFeature, Qwen2_5OmniProcessor

from tessera.errors import InputError
from tessera.layers.linear import MergedLinear
from tessera.models.qwen2_5_omni_audio import Qwen2_5OmniAudioEncoder, omni_audio_tokens
from tessera.models.qwen2_5_omni_positions import OmniItem, chunk_runs, omni_mrope_positions
from tessera.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from tessera.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
    _stacked,
)
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.audio import as_waveform
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import (
    AudioProcessorItems,
    MultiModalDataItems,
    MultiModalDataParser,
    VideoProcessorItems,
)
from tessera.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails

AUDIO_IN_VIDEO_KEYS = ("use_audio_in_video", "load_audio_from_video")


def thinker_config_of(config: Any) -> Any:
    """The thinker's config of a whole Qwen2.5-Omni config, or the config itself."""
    return getattr(config, "thinker_config", None) or config


class VideoWithAudioItems(VideoProcessorItems):
    """Videos heard with their sound tracks (mono float32 at the feature extractor's rate), one per video."""

    def __init__(self, videos: VideoProcessorItems, tracks: Sequence[np.ndarray]) -> None:
        super().__init__(videos.data, videos.metadata, tracks)

    def get_processor_data(self) -> Mapping[str, object]:
        return {**super().get_processor_data(), "video_audios": self.tracks}


class Qwen2_5OmniThinkerProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_config(self) -> Any:
        return thinker_config_of(self.ctx.model_config.hf_config)

    def get_hf_processor(self, **kwargs: object) -> Qwen2_5OmniProcessor:
        return self.ctx.get_hf_processor(Qwen2_5OmniProcessor, **kwargs)

    def get_feature_extractor(self) -> Any:
        return self.get_hf_processor().feature_extractor

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"audio": None, "image": None, "video": None}

    def _video_params(self) -> tuple[int, int, int, int, int]:
        """The video processor's sizes, under the pixel bounds the Omni processor passes it on every call."""
        patch, merge, temporal, min_pixels, max_pixels = super()._video_params()
        settings = self.ctx.get_call_settings(("min_pixels", "max_pixels", "size"), {})
        forced = Qwen2_5OmniProcessor.videos_kwargs.get("size") or {}
        if not any(settings.values()) and forced:
            min_pixels, max_pixels = forced.get("shortest_edge", min_pixels), forced.get("longest_edge", max_pixels)
        return patch, merge, temporal, min_pixels, max_pixels

    def get_max_audio_tokens(self) -> int:
        extractor = self.get_feature_extractor()
        return omni_audio_tokens(extractor.nb_max_frames)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {**super().get_mm_max_tokens_per_item(seq_len, mm_counts), "audio": self.get_max_audio_tokens()}


class Qwen2_5OmniThinkerDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().audio_token * mm_counts.get("audio", 0) + super().get_dummy_text(mm_counts)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        data = dict(super().get_dummy_mm_data(seq_len, mm_counts))
        if mm_counts.get("audio", 0):
            extractor = self.info.get_feature_extractor()
            longest = np.zeros(extractor.chunk_length * extractor.sampling_rate, dtype=np.float32)
            data["audio"] = [longest] * mm_counts["audio"]
        return data


class Qwen2_5OmniThinkerMultiModalProcessor(Qwen2VLMultiModalProcessor):
    def _get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(target_sr=self.info.get_feature_extractor().sampling_rate)

    def _to_mm_items(self, mm_data: Any, hf_processor_mm_kwargs: Mapping[str, object] = {}) -> MultiModalDataItems:
        """With use_audio_in_video, audio item i is video i's sound track: one item of the two."""
        mm_items = super()._to_mm_items(mm_data, hf_processor_mm_kwargs)
        merged = self.info.ctx.get_merged_mm_kwargs(hf_processor_mm_kwargs)
        videos = mm_items.get("video")
        if not any(merged.get(key) for key in AUDIO_IN_VIDEO_KEYS) or ("audio" not in mm_items and videos is None):
            return mm_items
        if "audio" not in mm_items and isinstance(videos, VideoProcessorItems) and None not in videos.tracks:
            rate = self.info.get_feature_extractor().sampling_rate  # the tracks decoded with the videos (chat)
            tracks = [as_waveform(track, rate, i) for i, track in enumerate(videos.tracks)]
            mm_items["video"] = VideoWithAudioItems(videos, tracks)
            return mm_items
        audios = mm_items.pop("audio", None) or AudioProcessorItems([])
        if videos is None or audios.get_count() != videos.get_count() or not isinstance(videos, VideoProcessorItems):
            count = 0 if videos is None else videos.get_count()
            raise InputError(
                f"use_audio_in_video takes audio item i as video i's sound track: got {audios.get_count()} audio "
                f"item(s) for {count} video(s)."
            )
        mm_items["video"] = VideoWithAudioItems(videos, audios.get_all())
        return mm_items

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """The HF processor takes `audio` (standalone recordings, then the videos' tracks) with its sampling rate
        and `audio_from_video_indices`; the tracks' features come back as the videos' own fields."""
        data = dict(mm_data)
        audios, tracks = list(data.pop("audios", None) or []), list(data.pop("video_audios", None) or [])
        if audios or tracks:
            data["audio"] = audios + tracks
            mm_kwargs = {**mm_kwargs, "sampling_rate": self.info.get_feature_extractor().sampling_rate}
        if tracks:
            data["audio_from_video_indices"] = [None] * len(audios) + list(range(len(tracks)))
        outputs = super()._call_hf_processor(prompt, data, mm_kwargs)
        if tracks:
            n = len(audios)
            features, mask = outputs.pop("input_features"), outputs.pop("feature_attention_mask")
            outputs["video_input_features"], outputs["video_feature_attention_mask"] = features[n:], mask[n:]
            if n:
                outputs["input_features"], outputs["feature_attention_mask"] = features[:n], mask[:n]
        return outputs

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs),
            input_features=MultiModalFieldConfig.batched("audio"),
            feature_attention_mask=MultiModalFieldConfig.batched("audio"),
            video_second_per_grid=MultiModalFieldConfig.batched("video"),
            video_input_features=MultiModalFieldConfig.batched("video"),
            video_feature_attention_mask=MultiModalFieldConfig.batched("video"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        updates = [u for u in super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
                   if u.modality == "image"]  # fmt: skip
        config = self.info.get_hf_config()
        merge = config.vision_config.spatial_merge_size
        merged = self.info.ctx.get_merged_mm_kwargs(hf_processor_mm_kwargs)
        per_second = merged.get("position_id_per_seconds", Qwen2_5OmniProcessor.position_id_per_seconds)
        per_chunk = int(per_second * merged.get("seconds_per_chunk", Qwen2_5OmniProcessor.seconds_per_chunk))
        audio_items = out_mm_kwargs.get_items("audio") if out_mm_kwargs.get_item_count("audio") else []
        video_items = out_mm_kwargs.get_items("video") if out_mm_kwargs.get_item_count("video") else []

        def audio_replacement(i: int) -> list[int]:
            frames = int(torch.as_tensor(audio_items[i]["feature_attention_mask"].data).sum())
            return [config.audio_token_id] * omni_audio_tokens(frames)

        def video_replacement(i: int) -> Any:
            item = video_items[i]
            grid = [int(x) for x in torch.as_tensor(item["video_grid_thw"].data).reshape(3)]
            if "video_feature_attention_mask" not in item:
                return [config.video_token_id] * (grid[0] * grid[1] * grid[2] // merge**2)
            frames = int(torch.as_tensor(item["video_feature_attention_mask"].data).sum())
            seconds = float(torch.as_tensor(item["video_second_per_grid"].data).reshape(()))
            plan = interleave_plan(grid, merge, seconds * per_second, omni_audio_tokens(frames), per_chunk)
            ids = [config.audio_start_token_id]
            for kind, count in plan:
                ids += [config.video_token_id if kind == "video" else config.audio_token_id] * count
            ids.append(config.audio_end_token_id)
            embeds = {config.video_token_id, config.audio_token_id}
            return PromptUpdateDetails(
                full=ids, is_embed=lambda full: torch.tensor([t in embeds for t in full.token_ids])
            )

        return [
            PromptReplacement(modality="audio", target=[config.audio_token_id], replacement=audio_replacement),
            *updates,
            PromptReplacement(modality="video", target=[config.video_token_id], replacement=video_replacement),
        ]


def interleave_plan(
    grid_thw: Sequence[int], merge: int, step: float, audio_tokens: int, per_chunk: int
) -> list[tuple[str, int]]:
    """[("video", n), ("audio", m), ...]: a video's frames and its track in 2-second chunks, in prompt order (the
    processor's rule: frame t at t * step, audio token k at k)."""
    per_frame = (grid_thw[1] // merge) * (grid_thw[2] // merge)
    frame_values = [t * step for t in range(grid_thw[0]) for _ in range(per_frame)]
    video_runs, audio_runs = chunk_runs(frame_values, per_chunk), chunk_runs(list(range(audio_tokens)), per_chunk)
    plan = []
    for j in range(max(len(video_runs), len(audio_runs))):
        if j < len(video_runs):
            plan.append(("video", video_runs[j][1] - video_runs[j][0]))
        if j < len(audio_runs):
            plan.append(("audio", audio_runs[j][1] - audio_runs[j][0]))
    return plan


class Qwen2_5OmniVisionTransformer(Qwen2_5_VisionTransformer):
    """Qwen2.5-VL's tower, its attention's q, k and v kept apart in checkpoints (loaded into one qkv)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        dim = config.hidden_size
        for block in self.blocks:
            block.attn.qkv = MergedLinear(dim, {"q": dim, "k": dim, "v": dim}, bias=True)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5OmniThinkerMultiModalProcessor,
    info=Qwen2_5OmniThinkerProcessingInfo,
    dummy_inputs=Qwen2_5OmniThinkerDummyInputsBuilder,
)
class Qwen2_5OmniThinkerForConditionalGeneration(Qwen2VLForConditionalGeneration):
    multimodal_parts = {"vision": "visual"}
    hf_to_tessera_prefixes = {
        "thinker.audio_tower.": "audio_tower.",
        "thinker.visual.": "visual.",
        "thinker.model.": "language_model.model.",
        "thinker.lm_head.": "language_model.lm_head.",
        "model.audio_tower.": "audio_tower.",
        "model.visual.": "visual.",
        "model.language_model.": "language_model.model.",
        "audio_tower.": "audio_tower.",
        "visual.": "visual.",
        "model.": "language_model.model.",
        "lm_head.": "language_model.lm_head.",
    }
    ignored_checkpoint_prefixes = ("talker.", "token2wav.")  # the speaking half of the whole model

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return {
            "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
            "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
            "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        }.get(modality)

    def __init__(self, config: Any) -> None:
        config = thinker_config_of(config)
        super(Qwen2VLForConditionalGeneration, self).__init__()
        self.config = config
        self.audio_tower = Qwen2_5OmniAudioEncoder(config.audio_config)
        self.visual = Qwen2_5OmniVisionTransformer(config.vision_config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = [config.audio_token_id, config.image_token_id, config.video_token_id]
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[list[torch.Tensor]]:
        """One tensor per item of the modality in kwargs; a video with its track: frames and audio interleaved."""
        if kwargs.get("input_features") is not None:
            return self._embed_audio(kwargs["input_features"], kwargs["feature_attention_mask"])
        embeddings = super().get_multimodal_embeddings(**kwargs)
        if embeddings is None or kwargs.get("video_input_features") is None:
            return embeddings
        tracks = self._embed_audio(kwargs["video_input_features"], kwargs["video_feature_attention_mask"])
        grids = torch.as_tensor(_stacked(kwargs["video_grid_thw"])).reshape(-1, 3)
        seconds = torch.as_tensor(_stacked(kwargs["video_second_per_grid"]), dtype=torch.float32).reshape(-1)
        per_chunk = int(self.config.position_id_per_seconds * self.config.seconds_per_chunk)
        merged = []
        for video, track, grid, spg in zip(embeddings, tracks, grids.tolist(), seconds.tolist()):
            plan = interleave_plan(grid, self.spatial_merge_size, spg * self.config.position_id_per_seconds,
                                   len(track), per_chunk)  # fmt: skip
            parts, used = [], {"video": 0, "audio": 0}
            for kind, count in plan:
                source = video if kind == "video" else track
                parts.append(source[used[kind] : used[kind] + count])
                used[kind] += count
            merged.append(torch.cat(parts))
        return merged

    def _embed_audio(self, features: Any, mask: Any) -> list[torch.Tensor]:
        features, mask = torch.as_tensor(_stacked(features)), torch.as_tensor(_stacked(mask))
        features = features.reshape(-1, *features.shape[-2:])
        frames = mask.reshape(features.shape[0], -1).sum(-1).tolist()
        dtype, device = module_dtype_device(self.audio_tower)
        valid = [f[:, : int(n)].to(device=device, dtype=dtype) for f, n in zip(features, frames)]
        return self.audio_tower(valid)

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        per_second = self.config.position_id_per_seconds
        items = []
        for feature in mm_features:
            position, data = feature.mm_position, feature.data
            if feature.modality == "audio":
                items.append(OmniItem(position.offset, position.length, "audio"))
                continue
            grid = tuple(int(x) for x in torch.as_tensor(data[f"{feature.modality}_grid_thw"].data).reshape(3))
            if feature.modality == "image":
                items.append(OmniItem(position.offset, position.length, "image", grid))
                continue
            seconds = torch.as_tensor(data["video_second_per_grid"].data, dtype=torch.float32).reshape(())
            step = float(seconds * torch.tensor(per_second, dtype=torch.float32))
            if "video_feature_attention_mask" in data:
                frames = int(torch.as_tensor(data["video_feature_attention_mask"].data).sum())
                items.append(OmniItem(position.offset, position.length, "video_audio", grid, step,
                                      omni_audio_tokens(frames)))  # fmt: skip
            else:
                items.append(OmniItem(position.offset, position.length, "video", grid, step))
        per_chunk = int(per_second * self.config.seconds_per_chunk)
        return omni_mrope_positions(len(input_tokens), items, self.spatial_merge_size, per_chunk)
