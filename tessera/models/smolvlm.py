"""SmolVLM and SmolVLM2: Idefics3's model (idefics3.py) behind SmolVLMProcessor, whose images are laid
out as Idefics3's and whose videos (SmolVLM2) are frames with timestamps.

Videos: the HF processor squares every frame to one tile and replaces each `<video>` by
"You are provided the following series of {six} frames from a {H:MM:SS} [H:MM:SS] video.\\n", then per
frame "\\nFrame from {MM:SS}:" + `<fake_token_around_image><global-img>` + image_seq_len `<image>` +
`<fake_token_around_image>`, then "\\n\\n"; timestamps are frame index / fps of the video's metadata
(24 fps when unknown), the duration the metadata's (else the last timestamp). That text is tokenized
with the prompt around it, so its ends merge with the neighbouring text. We therefore write the
introduction (up to the first frame's timestamp) and the closing newlines into the prompt text
around `<video>`, and `<video>` becomes the frames themselves, which begin and end with special tokens:
the tokens are HF's, and the item's placeholder is its frames. Only the `<image>` tokens take
embeddings. Each video's frames go to the HF video processor on their own (HF pads the frames of
videos processed together to the longest one's count, and would name that count in every
introduction); prompts with videos are tokenized apart from their items for the same reason.
`<video>` need not be a token: a tokenizer without it (as some checkpoints) has it as plain text, which
HF's processor replaces in the text, and so do we (a text target, prompt_updates.placeholder_target).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
from transformers import BatchFeature, SmolVLMConfig, SmolVLMProcessor

from tessera.models.idefics3 import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKEN,
    Idefics3DummyInputsBuilder,
    Idefics3ForConditionalGeneration,
    Idefics3MultiModalProcessor,
    Idefics3ProcessingInfo,
)
from tessera.models.interfaces import MultiModalEmbeddings
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import MultiModalDataItems, VideoProcessorItems, bare_video_metadata
from tessera.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails
from tessera.multimodal.prompt_updates import placeholder_target, placeholder_token_id
from tessera.multimodal.video import VideoFrames

VIDEO_TOKEN = "<video>"
UNKNOWN_FPS = 24  # what SmolVLMProcessor assumes for frames given without a frame rate
VIDEO_INTRO = "You are provided the following series of {frame_count} frames from a {duration} [H:MM:SS] video.\n"
FRAME_TIMESTAMP = "\nFrame from {timestamp}:"
MEDIA_OUTRO = "\n\n"
DEFAULT_MAX_FRAMES = 8  # profiling videos when the video processor names no frame count


class SmolVLMProcessingInfo(Idefics3ProcessingInfo):
    def get_hf_config(self) -> SmolVLMConfig:
        return self.ctx.get_hf_config(SmolVLMConfig)

    def get_hf_processor(self, **kwargs: object) -> SmolVLMProcessor:
        return self.ctx.get_hf_processor(SmolVLMProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None, "video": None}

    def get_frame_repl(self, mm_kwargs: Mapping[str, object] = {}) -> str:
        """One frame's tokens: a single, unsplit image."""
        return f"{FAKE_TOKEN}{GLOBAL_TOKEN}{IMAGE_TOKEN * self.get_image_seq_len(mm_kwargs)}{FAKE_TOKEN}"

    def get_video_texts(
        self, num_frames: int, metadata: Mapping[str, Any], mm_kwargs: Mapping[str, object] = {}
    ) -> tuple[str, str]:
        """(what goes before the frames: the introduction and the first frame's timestamp, the
        frames: each frame's tokens, the later ones after their timestamps), as SmolVLMProcessor."""
        from num2words import num2words  # SmolVLMProcessor's own dependency

        fps = metadata.get("fps") or UNKNOWN_FPS
        indices = metadata.get("frames_indices")
        indices = list(range(num_frames)) if indices is None else list(indices)
        seconds = [index / fps for index in indices]
        duration = metadata.get("duration")
        duration = int(duration) if duration is not None else int(seconds[-1])
        stamps = [FRAME_TIMESTAMP.format(timestamp=f"{int(s // 60):02d}:{int(s % 60):02d}") for s in seconds]
        intro = VIDEO_INTRO.format(frame_count=num2words(num_frames), duration=str(timedelta(seconds=duration)))
        frame = self.get_frame_repl(mm_kwargs)
        return intro + stamps[0], frame + "".join(stamp + frame for stamp in stamps[1:])

    def get_max_video_frames(self) -> int:
        return int(getattr(self.get_hf_processor().video_processor, "num_frames", None) or DEFAULT_MAX_FRAMES)

    def get_num_video_tokens(self, *, num_frames: int) -> int:
        """`<image>` tokens (embeddings) of a video of `num_frames` frames."""
        return num_frames * self.get_image_seq_len()

    def get_max_video_placeholder_tokens(self) -> int:
        """Most tokens a video adds to a prompt: its frames with the longest timestamps, and its
        introduction (an upper bound of its placeholder, which is the frames alone)."""
        num_frames = self.get_max_video_frames()
        tokenizer = self.get_tokenizer()
        stamps = [FRAME_TIMESTAMP.format(timestamp=f"{m:02d}:{s:02d}") for m in range(60) for s in range(60)]
        stamp = max(len(ids) for ids in tokenizer(stamps, add_special_tokens=False)["input_ids"])
        frame = len(tokenizer.encode(self.get_frame_repl(), add_special_tokens=False))
        # the introduction and the closing newlines the prompt gets around `<video>` count too, so
        # that the profile's worst-case prompt fits the context
        from num2words import num2words

        intro = VIDEO_INTRO.format(frame_count=num2words(num_frames), duration="999:59:59") + MEDIA_OUTRO
        return len(tokenizer.encode(intro, add_special_tokens=False)) + num_frames * (frame + stamp)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_placeholder_tokens(), "video": self.get_max_video_placeholder_tokens()}


class SmolVLMDummyInputsBuilder(Idefics3DummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0) + VIDEO_TOKEN * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        """Idefics3's images; black videos of the most frames, at 1 fps."""
        data: dict[str, Any] = {}
        if mm_counts.get("image", 0):
            data.update(super().get_dummy_mm_data(seq_len, mm_counts))
        if mm_counts.get("video", 0):
            num_frames = self.info.get_max_video_frames()
            width, height = self.info.get_image_size_with_most_features()
            frames = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
            video = VideoFrames(frames, 1.0, float(num_frames), num_frames, tuple(range(num_frames)))
            data["video"] = [video] * mm_counts["video"]
        return data


class SmolVLMMultiModalProcessor(Idefics3MultiModalProcessor):
    def apply(self, prompt, mm_data, hf_processor_mm_kwargs: Mapping[str, object] = {}, *, mm_uuids=None):
        """Write each video's introduction and closing newlines into the prompt around its `<video>`
        (see the module docstring), then process as usual."""
        mm_items = self._to_mm_items(mm_data)
        if "video" in mm_items and mm_items["video"].get_count():
            prompt = self._write_video_texts(prompt, mm_items, hf_processor_mm_kwargs)
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    def _video_texts(
        self, videos: VideoProcessorItems, item_idx: int, mm_kwargs: Mapping[str, object]
    ) -> tuple[str, str]:
        meta = videos.get_metadata(item_idx) or bare_video_metadata(videos.get(item_idx))
        return self.info.get_video_texts(videos.get_num_frames(item_idx), meta, mm_kwargs)

    def _write_video_texts(self, prompt: Any, mm_items: MultiModalDataItems, mm_kwargs: Mapping[str, object]) -> Any:
        videos = mm_items.get_items("video", VideoProcessorItems)
        intros = [self._video_texts(videos, i, mm_kwargs)[0] for i in range(videos.get_count())]
        if isinstance(prompt, str):
            parts = prompt.split(VIDEO_TOKEN)
            out = parts[0]
            for i, part in enumerate(parts[1:]):
                out += (intros[i] + VIDEO_TOKEN + MEDIA_OUTRO if i < len(intros) else VIDEO_TOKEN) + part
            return out
        tokenizer = self.info.get_tokenizer()
        video_token_id = placeholder_token_id(tokenizer, VIDEO_TOKEN)
        if video_token_id is None:  # `<video>` is text to this tokenizer: write into the prompt's text
            text = self._write_video_texts(self._codec.decode(list(prompt)), mm_items, mm_kwargs)
            return tokenizer.encode(text, add_special_tokens=False)
        out_ids: list[int] = []
        count = 0
        for token in prompt:
            if token == video_token_id and count < len(intros):
                out_ids += tokenizer.encode(intros[count], add_special_tokens=False) + [token]
                out_ids += tokenizer.encode(MEDIA_OUTRO, add_special_tokens=False)
                count += 1
            else:
                out_ids.append(token)
        return out_ids

    def _apply_hf_processor_main(
        self, prompt, mm_items: MultiModalDataItems, hf_processor_mm_kwargs, *, enable_hf_prompt_update: bool
    ):
        """Prompts with videos: the text tokenized apart from the items, which are placed by us."""
        if "video" in mm_items:
            enable_hf_prompt_update = False
        return super()._apply_hf_processor_main(
            prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=enable_hf_prompt_update
        )

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Images through the HF processor (as Idefics3's); each video through its video processor."""
        mm_data = dict(mm_data)
        videos = mm_data.pop("videos", None) or []
        mm_data.pop("video_metadata", None)
        text = prompt.replace(VIDEO_TOKEN, "") if videos else prompt
        processed = super()._call_hf_processor(text, mm_data, mm_kwargs)
        if videos:
            video_processor = self.info.get_hf_processor(**mm_kwargs).video_processor
            outs = [video_processor(videos=[v], do_sample_frames=False, return_tensors="pt") for v in videos]
            processed["pixel_values_videos"] = torch.cat([out["pixel_values"][0] for out in outs])
            processed["pixel_attention_mask_videos"] = torch.cat([out["pixel_attention_mask"][0] for out in outs])
            processed["video_num_frames"] = torch.tensor([len(v) for v in videos])
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        num_frames = hf_inputs.get("video_num_frames", torch.empty(0, dtype=torch.long))
        return dict(
            **super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs),
            pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", num_frames),
            pixel_attention_mask_videos=MultiModalFieldConfig.flat_from_sizes("video", num_frames),
            video_num_frames=MultiModalFieldConfig.batched("video"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        (image_update,) = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        tokenizer = self.info.get_tokenizer()
        image_token_id = self.info.get_hf_config().image_token_id

        def get_video_replacement(item_idx: int) -> PromptUpdateDetails:
            videos = mm_items.get_items("video", VideoProcessorItems)
            _, frames = self._video_texts(videos, item_idx, hf_processor_mm_kwargs)
            return PromptUpdateDetails.select_token_id(
                tokenizer.encode(frames, add_special_tokens=False), image_token_id
            )

        video_update = PromptReplacement(
            modality="video", target=placeholder_target(tokenizer, VIDEO_TOKEN), replacement=get_video_replacement
        )
        return [image_update, video_update]


@MULTIMODAL_REGISTRY.register_processor(
    SmolVLMMultiModalProcessor, info=SmolVLMProcessingInfo, dummy_inputs=SmolVLMDummyInputsBuilder
)
class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return {"image": IMAGE_TOKEN, "video": VIDEO_TOKEN}.get(modality)

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """Images as Idefics3's; a video: one [frames * image_seq_len, hidden] tensor, frames in order."""
        if kwargs.get("pixel_values_videos") is not None:
            return self._embed_tiles(
                kwargs["pixel_values_videos"], kwargs.get("pixel_attention_mask_videos"), kwargs["video_num_frames"]
            )
        return super().get_multimodal_embeddings(**kwargs)
