"""Qwen3-VL (dense): Qwen2-VL's processing with videos laid out frame by frame in time, a vision tower
with a learned position table and DeepStack features (qwen3_vl_vision.py), and a Qwen3 decoder with
interleaved M-RoPE that adds the DeepStack features to its first layers' outputs. As vLLM's qwen3_vl.py.

Videos: the HF processor replaces each `<|video_pad|>` by, for every temporal patch (grid frame),
`<{t:.1f} seconds><|vision_start|>` + h * w / merge**2 pads + `<|vision_end|>`, t the mean time of the
patch's first and last frame (frame index / fps of the video's metadata; 24 fps when unknown). Only
the pads take embeddings. M-RoPE places every grid frame as an image of its own at its first pad (the
timestamps between frames are text), so frames advance in time through the text positions.

DeepStack: the tower returns its merged tokens and one more [n, hidden] tensor per deepstack block;
item embeddings carry them side by side ([n, hidden * (1 + deepstack)], so the encoder cache and the
chunked merge keep them together), and the decoder adds feature k to the hidden states of the
placeholder tokens after layer k.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from transformers import BatchFeature, Qwen3VLConfig, Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from tessera.errors import InputError
from tessera.models.causal_lm import CausalLM
from tessera.models.interfaces import MultiModalEmbeddings
from tessera.models.mrope_positions import VisionGrid, mrope_input_positions
from tessera.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from tessera.models.qwen3 import Qwen3Model
from tessera.models.qwen3_vl_vision import Qwen3VLVisionTransformer
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalKwargs
from tessera.multimodal.parse import MultiModalDataItems, VideoProcessorItems, bare_video_metadata
from tessera.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails
from tessera.multimodal.video import VideoFrames

UNKNOWN_FPS = 24  # what transformers assumes for a video whose frame rate it is not told


class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_config(self) -> Qwen3VLConfig:
        return self.ctx.get_hf_config(Qwen3VLConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen3VLProcessor:
        return self.ctx.get_hf_processor(Qwen3VLProcessor, **kwargs)

    def get_num_video_tokens(self, *, image_width: int, image_height: int, num_frames: int) -> int:
        """Qwen3-VL's video processor bounds the pixels of the whole clip, so frames shrink as they
        grow in number; its own count (at least one temporal patch of frames)."""
        video_processor = self.get_hf_processor().video_processor
        num_frames = max(num_frames, video_processor.temporal_patch_size)
        patches = video_processor.get_num_of_video_patches(num_frames, image_height, image_width)
        return patches // video_processor.merge_size**2

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """Placeholder tokens: a video's also count each grid frame's timestamp and delimiters (at most
        the tokens of a 5-digit timestamp), so that the profile's worst-case prompt fits the context."""
        tokens = dict(super().get_mm_max_tokens_per_item(seq_len, mm_counts))
        temporal = self.get_hf_processor().video_processor.temporal_patch_size
        grid_frames = -(-self.get_num_frames_with_most_features(seq_len, mm_counts) // temporal)
        timestamp = self.get_tokenizer().encode("<99999.9 seconds>", add_special_tokens=False)
        tokens["video"] += grid_frames * (len(timestamp) + 2)
        return tokens


def frame_timestamps(frames_indices: Sequence[int], fps: Optional[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each grid frame: the mean time of the first and last source frame of its temporal
    patch (the last frame repeated to fill the last patch), as transformers' Qwen3VLProcessor."""
    indices = list(frames_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    fps = fps or UNKNOWN_FPS
    return [
        (indices[i] / fps + indices[i + temporal_patch_size - 1] / fps) / 2
        for i in range(0, len(indices), temporal_patch_size)
    ]


class Qwen3VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        """Qwen2-VL's, the videos with a frame rate (HF's default sampling rate, 2 fps) so that their
        timestamps need no guess."""
        data = dict(super().get_dummy_mm_data(seq_len, mm_counts))
        fps = 2.0
        data["video"] = [
            VideoFrames(video, fps, len(video) / fps, len(video), tuple(range(len(video))))
            for video in data.get("video", [])
        ]
        return {modality: items for modality, items in data.items() if len(items)}


class Qwen3VLMultiModalProcessor(Qwen2VLMultiModalProcessor):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Videos shorter than one temporal patch are refused by name (the HF processor cannot size them)."""
        temporal = self.info.get_hf_processor().video_processor.temporal_patch_size
        for video in mm_data.get("videos") or []:
            if len(video) < temporal:
                raise InputError(
                    f"Qwen3-VL takes videos of at least {temporal} frames; got one of {len(video)}. "
                    "Send a longer clip or sample more frames (num_frames)."
                )
        return super()._call_hf_processor(prompt, mm_data, mm_kwargs)

    def _video_metadata(
        self, videos: VideoProcessorItems, item_idx: int, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> VideoMetadata:
        """The item's metadata as the HF processor ends up with it: the frames given (sampled again
        only if the caller's kwargs ask the processor to)."""
        meta = videos.get_metadata(item_idx) or bare_video_metadata(videos.get(item_idx))
        metadata = VideoMetadata(**meta)
        kwargs = self.info.ctx.get_merged_mm_kwargs(hf_processor_mm_kwargs)
        if kwargs.get("do_sample_frames"):
            video_processor = self.info.get_hf_processor().video_processor
            indices = video_processor.sample_frames(
                metadata, num_frames=kwargs.get("num_frames"), fps=kwargs.get("fps")
            )
            metadata.frames_indices = [metadata.frames_indices[i] for i in indices]
        return metadata

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        image_update, _ = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        hf_config = self.info.get_hf_config()
        tokenizer = self.info.get_tokenizer()
        temporal_patch_size = hf_config.vision_config.temporal_patch_size
        merge_size = hf_config.vision_config.spatial_merge_size
        video_token_id = hf_config.video_token_id
        videos = mm_items.get_items("video", VideoProcessorItems) if "video" in mm_items else None
        out_videos = out_mm_kwargs.get_items("video") if out_mm_kwargs.get_item_count("video") else []

        def get_video_replacement(item_idx: int) -> PromptUpdateDetails:
            _, h, w = (int(x) for x in out_videos[item_idx]["video_grid_thw"].data.reshape(3))
            metadata = self._video_metadata(videos, item_idx, hf_processor_mm_kwargs)
            tokens: list[int] = []
            for seconds in frame_timestamps(metadata.frames_indices, metadata.fps, temporal_patch_size):
                tokens += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
                tokens += [hf_config.vision_start_token_id, *[video_token_id] * (h * w // merge_size**2)]
                tokens.append(hf_config.vision_end_token_id)
            return PromptUpdateDetails.select_token_id(tokens, video_token_id)

        video_update = PromptReplacement(modality="video", target=[video_token_id], replacement=get_video_replacement)
        return [image_update, video_update]


class Qwen3VLTextModel(Qwen3Model):
    """Qwen3's decoder; `deepstack_embeds` [k, T, hidden] (zero outside the vision tokens) is added to
    the output of layer i for i < k."""

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
        deepstack_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        for index, layer in enumerate(self.layers):
            hidden_states = layer(positions, hidden_states)
            if deepstack_embeds is not None and index < len(deepstack_embeds):
                hidden_states = hidden_states + deepstack_embeds[index]
        return self.norm(hidden_states)


class Qwen3VLTextForCausalLM(CausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config, Qwen3VLTextModel(config))

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
        deepstack_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds, deepstack_embeds)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls = Qwen3VLVisionTransformer

    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__(config)
        self.hidden_size = config.text_config.hidden_size
        self.num_deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
        self._deepstack_embeds: Optional[torch.Tensor] = None  # from get_input_embeddings to forward

    def _run_vision_tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[N / merge**2, hidden * (1 + deepstack)]: the merged tokens, then each DeepStack feature."""
        merged, deepstack = self.visual(pixel_values, grid_thw)
        return torch.cat([merged, *deepstack], dim=-1)

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Optional[MultiModalEmbeddings] = None,
        *,
        is_multimodal: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The merged tokens go into the embeddings; the DeepStack features wait for `forward`."""
        self._deepstack_embeds = None
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return super().get_input_embeddings(input_ids)
        rows = torch.cat([e.reshape(-1, e.shape[-1]) for e in multimodal_embeddings])  # [n, hidden * (1 + k)]
        inputs_embeds = super().get_input_embeddings(
            input_ids, [rows[:, : self.hidden_size]], is_multimodal=is_multimodal
        )
        if is_multimodal is None:
            is_multimodal = torch.isin(input_ids, torch.tensor(self.placeholder_token_id, device=input_ids.device))
        deepstack = inputs_embeds.new_zeros(self.num_deepstack, *inputs_embeds.shape)  # [k, T, hidden]
        features = rows[:, self.hidden_size :].reshape(len(rows), self.num_deepstack, self.hidden_size)
        deepstack[:, is_multimodal.to(inputs_embeds.device)] = features.transpose(0, 1).to(inputs_embeds.dtype)
        self._deepstack_embeds = deepstack
        return inputs_embeds

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        """Images as Qwen2-VL; each grid frame of a video at its own run of pads, one frame deep."""
        grids = []
        for feature in mm_features:
            if feature.modality not in ("image", "video"):
                raise ValueError(f"Qwen3-VL takes images and videos; got a {feature.modality}")
            grid = feature.data[f"{feature.modality}_grid_thw"].data
            t, h, w = (int(x) for x in torch.as_tensor(grid).reshape(3))
            position = feature.mm_position
            per_frame = h * w // self.spatial_merge_size**2
            if position.is_embed is None:
                starts = [position.offset + f * per_frame for f in range(t)]
            else:
                is_embed = torch.as_tensor(position.is_embed, dtype=torch.bool)
                run_starts = is_embed & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_embed[:-1]])
                starts = (position.offset + run_starts.nonzero().flatten()).tolist()
            if feature.modality == "image":
                grids.append(VisionGrid(starts[0], (t, h, w)))
            else:
                grids += [VisionGrid(start, (1, h, w)) for start in starts]
        return mrope_input_positions(len(input_tokens), grids, self.spatial_merge_size)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; positions [3, T]; the DeepStack features of the embeddings
        `get_input_embeddings` just made."""
        deepstack, self._deepstack_embeds = self._deepstack_embeds, None
        if deepstack is not None and (inputs_embeds is None or deepstack.shape[1] != inputs_embeds.shape[0]):
            raise RuntimeError("forward() must get the inputs_embeds that get_input_embeddings() just returned")
        return self.language_model(input_ids, positions, inputs_embeds, deepstack_embeds=deepstack)
