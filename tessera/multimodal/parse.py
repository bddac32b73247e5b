"""Turn the user's `multi_modal_data` into validated items per modality (the images' and videos' checks:
``media_checks.py``)."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections import UserDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Optional, TypeVar, Union

import numpy as np
import torch

from ..errors import InputError
from .audio import as_waveform
from .inputs import ImageItem, MultiModalDataDict
from .media_checks import ImageSize, as_image_list, as_videos, image_size_of

_T = TypeVar("_T")
_I = TypeVar("_I", bound="ModalityDataItems")


class ModalityDataItems(ABC, Generic[_T]):
    """The items of one modality in one prompt."""

    def __init__(self, data: Sequence[_T], modality: str) -> None:
        self.data = data
        self.modality = modality

    def __repr__(self) -> str:
        return f"{type(self).__name__}(modality={self.modality!r}, len={len(self)})"

    def __len__(self) -> int:
        return self.get_count()

    def __getitem__(self, index: int) -> _T:
        return self.get(index)

    def get_count(self) -> int:
        return len(self.data)

    def get(self, index: int) -> _T:
        return self.data[index]

    def get_all(self) -> list[_T]:
        return [self.get(i) for i in range(self.get_count())]

    def get_hash_item(self, index: int) -> object:
        """What identifies item `index` for the caches: the item itself, plus anything beside it
        that changes how it is processed (a video's metadata)."""
        return self.get(index)

    def subset(self, indices: Sequence[int]) -> "ModalityDataItems[_T]":
        """The items at `indices`, in that order (with whatever the class keeps per item)."""
        subset = copy.copy(self)
        subset.data = [self.get(i) for i in indices]
        return subset

    @abstractmethod
    def get_processor_data(self) -> Mapping[str, object]:
        """What to pass to the HF processor."""

    @abstractmethod
    def get_passthrough_data(self) -> Mapping[str, object]:
        """What goes to the model without the HF processor."""


class ProcessorBatchItems(ModalityDataItems[_T]):
    """Raw items that the HF processor turns into tensors (keyword: the modality in plural)."""

    def get_processor_data(self) -> Mapping[str, object]:
        return {f"{self.modality}s": self.data}

    def get_passthrough_data(self) -> Mapping[str, object]:
        return {}


class EmbeddingItems(ModalityDataItems[torch.Tensor]):
    """Precomputed embeddings, one (feature_size, hidden_size) tensor per item; `metadata`, per item, the tensors a
    model needs beside them (Qwen-VL's `image_grid_thw`), given as vLLM takes them: {"image_embeds": ...,
    "image_grid_thw": ...} per item."""

    def __init__(self, data: Sequence[torch.Tensor], modality: str,
                 metadata: Optional[Sequence[Mapping[str, torch.Tensor]]] = None) -> None:  # fmt: skip
        super().__init__(data, modality)
        self.metadata = list(metadata) if metadata else []

    def get_processor_data(self) -> Mapping[str, object]:
        return {}

    def get_passthrough_data(self) -> Mapping[str, object]:
        """The embeddings per item; with metadata, concatenated (a flat field, as the HF processor's pixels) and
        each metadata key stacked over the items."""
        if not self.metadata:
            return {f"{self.modality}_embeds": self.data}
        keys = sorted(self.metadata[0])
        stacked = {key: torch.stack([torch.as_tensor(m[key]).reshape(-1) for m in self.metadata]) for key in keys}
        return {f"{self.modality}_embeds": torch.cat(list(self.data)), **stacked}

    def get_hash_item(self, index: int) -> object:
        if not self.metadata:
            return super().get_hash_item(index)
        return (self.get(index), *(self.metadata[index][key] for key in sorted(self.metadata[index])))

    def get_feature_size(self, item_index: int) -> int:
        return len(self.get(item_index))


class ImageProcessorItems(ProcessorBatchItems[ImageItem]):
    def __init__(self, data: Sequence[ImageItem]) -> None:
        super().__init__(data, "image")

    def get_image_size(self, item_index: int) -> ImageSize:
        return image_size_of(self.get(item_index))


class AudioProcessorItems(ProcessorBatchItems[np.ndarray]):
    """Mono float32 waveforms at the model's sampling rate (multimodal/audio.py)."""

    def __init__(self, data: Sequence[np.ndarray]) -> None:
        super().__init__(data, "audio")

    def get_audio_length(self, item_index: int) -> int:
        return len(self.get(item_index))


class ImageEmbeddingItems(EmbeddingItems):
    def __init__(self, data: Union[torch.Tensor, Sequence[torch.Tensor]],
                 metadata: Optional[Sequence[Mapping[str, torch.Tensor]]] = None) -> None:  # fmt: skip
        super().__init__(data, "image", metadata)


class VideoProcessorItems(ProcessorBatchItems[np.ndarray]):
    """Videos, each a uint8 [T, H, W, 3] RGB array (vLLM's VideoProcessorItems); `metadata` holds
    each video's `VideoFrames.metadata` when it came decoded from a file, else None."""

    def __init__(
        self,
        data: Sequence[np.ndarray],
        metadata: Optional[Sequence[Optional[dict[str, Any]]]] = None,
        tracks: Optional[Sequence[Optional[tuple[np.ndarray, int]]]] = None,
    ) -> None:
        super().__init__(data, "video")
        self.metadata = list(metadata) if metadata is not None else [None] * len(data)
        self.tracks = list(tracks) if tracks is not None else [None] * len(data)
        """Each video's sound track ((waveform, rate), from a `VideoFrames` decoded `with_audio`), else None."""

    def get_num_frames(self, item_index: int) -> int:
        return int(self.get(item_index).shape[0])

    def get_frame_size(self, item_index: int) -> ImageSize:
        video = self.get(item_index)
        return ImageSize(width=video.shape[2], height=video.shape[1])

    def get_metadata(self, item_index: int) -> Optional[dict[str, Any]]:
        return self.metadata[item_index]

    def get_processor_data(self) -> Mapping[str, object]:
        """The frames, and when any video came with metadata, `video_metadata` for all of them (the
        others get what transformers infers for a bare array: frames 0..T-1 at an unknown fps), so
        processors that place frames in time (Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's
        timestamps) see the source's frame rate and which frames were sampled."""
        data = dict(super().get_processor_data())
        if any(meta is not None for meta in self.metadata):
            data["video_metadata"] = [
                dict(meta) if meta is not None else bare_video_metadata(video)
                for video, meta in zip(self.data, self.metadata)
            ]
        return data

    def get_hash_item(self, index: int) -> object:
        meta, track = self.metadata[index], self.tracks[index]
        item = self.get(index) if meta is None else (self.get(index), meta)
        return item if track is None else (item, track)

    def subset(self, indices: Sequence[int]) -> "VideoProcessorItems":
        subset = super().subset(indices)
        subset.metadata = [self.metadata[i] for i in indices]
        subset.tracks = [self.tracks[i] for i in indices]
        return subset


def bare_video_metadata(video: np.ndarray) -> dict[str, Any]:
    """transformers' metadata for frames given without any (video_utils.make_batched_metadata)."""
    return {
        "total_num_frames": len(video), "fps": None, "duration": None, "frames_indices": list(range(len(video))),
        "height": int(video.shape[1]), "width": int(video.shape[2]),
    }  # fmt: skip


class MultiModalDataItems(UserDict[str, ModalityDataItems[Any]]):
    """Items of every modality of one prompt, keyed by modality."""

    def get_count(self, modality: str, *, strict: bool = True) -> int:
        if modality not in self:
            if strict:
                raise KeyError(f"Modality {modality!r} not found; available: {sorted(self)}")
            return 0
        return self[modality].get_count()

    def get_all_counts(self) -> Mapping[str, int]:
        return {m: items.get_count() for m, items in self.items()}

    def get_items(self, modality: str, typ: Union[type[_I], tuple[type[_I], ...]]) -> _I:
        if modality not in self:
            raise KeyError(f"Modality {modality!r} not found; available: {sorted(self)}")
        items = self[modality]
        if not isinstance(items, typ):
            raise TypeError(f"Expected {modality} items of type {typ}, found {type(items).__name__}")
        return items  # type: ignore[return-value]


class MultiModalDataParser:
    """Validates user data. Images: PIL images, HWC uint8 arrays, CHW tensors or lists of them;
    precomputed embeddings under the key ``"image_embeds"``: a (num_items, feature_size, hidden)
    tensor or a list of (feature_size, hidden) tensors. Videos: one video as a uint8 [T, H, W, 3]
    array, a list of PIL images, a list of HWC uint8 arrays or a decoded `VideoFrames`, or a list
    of such videos. Audio: a waveform (1-D, at the model's rate), a (waveform, sampling_rate) pair, or a
    list of them; resampled to `target_sr` (the model's feature extractor's rate) where given."""

    def __init__(self, *, target_sr: Optional[int] = None) -> None:
        self.target_sr = target_sr

    def parse_mm_data(self, mm_data: MultiModalDataDict) -> MultiModalDataItems:
        items = MultiModalDataItems()
        for key, data in mm_data.items():
            if data is None:
                continue
            if key.endswith("_embeds"):
                modality = key[: -len("_embeds")]
                parsed: ModalityDataItems = self._parse_embeddings(modality, data)
            elif key == "image":
                parsed = ImageProcessorItems(as_image_list(data))
            elif key == "video":
                parsed = VideoProcessorItems(*as_videos(data))
            elif key == "audio":
                parsed = self._parse_audio(data)
            else:
                parsed = ProcessorBatchItems(data if isinstance(data, list) else [data], key)
            if parsed.get_count() == 0:
                continue  # an empty list means no items, as if the key were absent
            if parsed.modality in items:
                raise ValueError(
                    f"Both raw {parsed.modality} items and precomputed {parsed.modality}_embeds were given; "
                    "pass one or the other."
                )
            items[parsed.modality] = parsed
        return items

    def _parse_audio(self, data: Any) -> AudioProcessorItems:
        single = isinstance(data, tuple) or (isinstance(data, np.ndarray) and data.ndim == 1)
        if not single and not isinstance(data, (list, np.ndarray)):
            raise InputError(
                "audio must be a waveform, a (waveform, sampling_rate) pair or a list of them, "
                f"got {type(data).__name__}."
            )
        items = [data] if single else list(data)
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, np.ndarray, list, torch.Tensor)):
                raise InputError(f"audio item {i} must be a waveform or a (waveform, sampling_rate) pair.")
        if self.target_sr is None:  # a model without audio refuses the items by name later
            return AudioProcessorItems([np.asarray(item[0] if isinstance(item, tuple) else item) for item in items])
        return AudioProcessorItems([as_waveform(item, self.target_sr, i) for i, item in enumerate(items)])

    def _parse_embeddings(self, modality: str, data: Any) -> EmbeddingItems:
        key = f"{modality}_embeds"
        dicts = [data] if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else None
        if dicts and all(isinstance(d, Mapping) for d in dicts):  # with metadata: {key: .., "image_grid_thw": ..}
            if not all(isinstance(d.get(key), torch.Tensor) and d[key].ndim == 2 for d in dicts):
                raise ValueError(f"Each {modality}_embeds item must hold {key!r}: a (features, hidden) tensor.")
            if len({tuple(sorted(d)) for d in dicts}) != 1:
                raise ValueError(f"Every {modality}_embeds item must carry the same metadata keys.")
            metadata = [{k: torch.as_tensor(v) for k, v in d.items() if k != key} for d in dicts]
            tensors = [d[key] for d in dicts]
            if modality == "image":
                return ImageEmbeddingItems(tensors, metadata)
            return EmbeddingItems(tensors, modality, metadata)
        tensors = list(data) if isinstance(data, (list, tuple)) else None
        if isinstance(data, torch.Tensor) and data.ndim == 3:
            tensors = list(data.unbind(0))
        if tensors is None or not all(isinstance(t, torch.Tensor) and t.ndim == 2 for t in tensors):
            raise ValueError(
                f"{modality}_embeds must be a (num_items, feature_size, hidden_size) tensor or a list of "
                "(feature_size, hidden_size) tensors."
            )
        return ImageEmbeddingItems(tensors) if modality == "image" else EmbeddingItems(tensors, modality)
