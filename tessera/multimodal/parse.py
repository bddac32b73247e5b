"""Turn the user's `multi_modal_data` into validated items per modality."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import UserDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar, Union

import numpy as np
import torch
from PIL import Image

from ..errors import InputError
from .inputs import ImageItem, MultiModalDataDict
from .media import MediaPolicy

_T = TypeVar("_T")
_I = TypeVar("_I", bound="ModalityDataItems")


class ImageSize(NamedTuple):
    width: int
    height: int


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
    """Precomputed embeddings, one (feature_size, hidden_size) tensor per item."""

    def get_processor_data(self) -> Mapping[str, object]:
        return {}

    def get_passthrough_data(self) -> Mapping[str, object]:
        return {f"{self.modality}_embeds": self.data}

    def get_feature_size(self, item_index: int) -> int:
        return len(self.get(item_index))


class ImageProcessorItems(ProcessorBatchItems[ImageItem]):
    def __init__(self, data: Sequence[ImageItem]) -> None:
        super().__init__(data, "image")

    def get_image_size(self, item_index: int) -> ImageSize:
        return image_size_of(self.get(item_index))


class ImageEmbeddingItems(EmbeddingItems):
    def __init__(self, data: Union[torch.Tensor, Sequence[torch.Tensor]]) -> None:
        super().__init__(data, "image")


def image_size_of(image: ImageItem) -> ImageSize:
    if isinstance(image, Image.Image):
        return ImageSize(*image.size)
    if isinstance(image, np.ndarray):  # HWC
        return ImageSize(width=image.shape[1], height=image.shape[0])
    return ImageSize(width=image.shape[-1], height=image.shape[-2])  # CHW tensor


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
    tensor or a list of (feature_size, hidden) tensors."""

    def parse_mm_data(self, mm_data: MultiModalDataDict) -> MultiModalDataItems:
        items = MultiModalDataItems()
        for key, data in mm_data.items():
            if data is None:
                continue
            if key.endswith("_embeds"):
                modality = key[: -len("_embeds")]
                parsed: ModalityDataItems = self._parse_embeddings(modality, data)
            elif key == "image":
                parsed = ImageProcessorItems(_as_image_list(data))
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

    def _parse_embeddings(self, modality: str, data: Any) -> EmbeddingItems:
        tensors = list(data) if isinstance(data, (list, tuple)) else None
        if isinstance(data, torch.Tensor) and data.ndim == 3:
            tensors = list(data.unbind(0))
        if tensors is None or not all(isinstance(t, torch.Tensor) and t.ndim == 2 for t in tensors):
            raise ValueError(
                f"{modality}_embeds must be a (num_items, feature_size, hidden_size) tensor or a list of "
                "(feature_size, hidden_size) tensors."
            )
        return ImageEmbeddingItems(tensors) if modality == "image" else EmbeddingItems(tensors, modality)


def _as_image_list(data: Any) -> list[ImageItem]:
    if isinstance(data, np.ndarray) and data.ndim == 4:
        data = list(data)
    elif isinstance(data, torch.Tensor) and data.ndim == 4:
        data = list(data.unbind(0))
    elif not isinstance(data, (list, tuple)):
        data = [data]
    return [_check_image(image, i) for i, image in enumerate(data)]


# HF image processors guess the channel axis of an image from its shape, and guess wrong for
# fewer than 4 rows (see tests/multimodal/test_image_decode.py); the server's limit as well.
MIN_IMAGE_SIDE = MediaPolicy().min_side


def _check_image(image: Any, index: int) -> ImageItem:
    image = _check_image_type(image, index)
    width, height = image_size_of(image)
    if min(width, height) < MIN_IMAGE_SIDE:
        raise InputError(
            f"Image {index} is {width}x{height} pixels; images must be at least {MIN_IMAGE_SIDE} pixels on each side."
        )
    return image


def _check_image_type(image: Any, index: int) -> ImageItem:
    where = f"Image {index}"
    if isinstance(image, Image.Image):
        try:
            image.load()  # decode now, so a truncated file fails here with a clear message
        except Exception as e:
            raise ValueError(f"{where} could not be decoded ({e}); pass a complete, valid image file.") from e
        return image
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] not in (1, 3, 4) or image.dtype != np.uint8:
            raise ValueError(
                f"{where} is a numpy array of shape {image.shape} and dtype {image.dtype}; "
                "expected an HWC uint8 array with 1, 3 or 4 channels."
            )
        return image
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
            raise ValueError(
                f"{where} is a tensor of shape {tuple(image.shape)}; expected a CHW tensor with 1, 3 or 4 "
                "channels (pass precomputed embeddings under 'image_embeds')."
            )
        return image
    raise ValueError(
        f"{where} has unsupported type {type(image).__name__}; pass a PIL.Image.Image, an HWC uint8 "
        "numpy array or a CHW torch tensor."
    )
