"""What the multimodal processor produces: placeholder ranges, per-item tensors and their schema.

The HF processor returns one batch of tensors for all items of a prompt. `MultiModalFieldConfig`
says how each tensor splits into items, so that items can be cached one by one, re-batched in
any order and reduced back into model inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import UserDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, TypedDict, Union

import numpy as np
import torch
from PIL.Image import Image

# Nested tensors: a tensor, or a list of them when items have different shapes.
NestedTensors = Union[list["NestedTensors"], list[torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]

ImageItem = Union[Image, np.ndarray, torch.Tensor]
"""One image: a PIL image, an HWC uint8 numpy array or a CHW torch tensor."""

ModalityData = Union[Any, list[Any]]
MultiModalDataDict = Mapping[str, ModalityData]
"""User input per modality, e.g. ``{"image": [img1, img2]}`` or ``{"image_embeds": tensor}``."""

MultiModalUUIDDict = Mapping[str, Union[Sequence[Optional[str]], str]]
"""Caller-given ids of items, per modality: a list aligned with the items (None: hash the
content), or a string for a single item (vLLM's `multi_modal_uuids`)."""


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one multimodal item sits in the prompt token ids."""

    offset: int
    """Index of the first placeholder token."""

    length: int
    """Number of placeholder tokens."""

    is_embed: Optional[torch.Tensor] = None
    """Boolean mask over the `length` positions: True where the item's embeddings go.
    None means every position receives an embedding."""

    def get_num_embeds(self) -> int:
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlaceholderRange):
            return NotImplemented
        if (self.offset, self.length) != (other.offset, other.length):
            return False
        if self.is_embed is None or other.is_embed is None:
            return self.is_embed is None and other.is_embed is None
        return bool(torch.equal(self.is_embed, other.is_embed))

    __hash__ = None  # type: ignore[assignment]  # mutable tensor inside


@dataclass
class MultiModalFieldElem:
    """The slice of one HF output tensor that belongs to one item."""

    modality: str
    key: str
    data: NestedTensors
    field: "BaseMultiModalField"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MultiModalFieldElem):
            return NotImplemented
        return (
            (self.modality, self.key) == (other.modality, other.key)
            and type(self.field) is type(other.field)
            and nested_tensors_equal(self.data, other.data)
        )


def nested_tensors_equal(a: NestedTensors, b: NestedTensors) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(nested_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def nested_tensors_nbytes(data: NestedTensors) -> int:
    if isinstance(data, torch.Tensor):
        return data.nelement() * data.element_size()
    if isinstance(data, (list, tuple)):
        return sum(nested_tensors_nbytes(x) for x in data)
    return 0


def _stack_or_list(tensors: list[torch.Tensor], cat_dim: Optional[int] = None) -> NestedTensors:
    """Stack (or concatenate along `cat_dim`) when the shapes allow it, else keep a list."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        if cat_dim is not None:  # flat items sliced from a list: join the lists
            return [x for t in tensors for x in t]
        return list(tensors)
    if cat_dim is None:
        return torch.stack(tensors) if len({t.shape for t in tensors}) == 1 else list(tensors)
    other_dims = {t.shape[: cat_dim % t.ndim] + t.shape[cat_dim % t.ndim + 1 :] for t in tensors}
    if len(other_dims) == 1:
        return torch.cat(tensors, dim=cat_dim)
    return list(tensors)


class BaseMultiModalField(ABC):
    """How one HF output tensor maps to items (`build_elems`) and back (`reduce_data`)."""

    @abstractmethod
    def build_elems(self, modality: str, key: str, data: NestedTensors) -> Sequence[MultiModalFieldElem]: ...

    @abstractmethod
    def reduce_data(self, elems: list[MultiModalFieldElem]) -> NestedTensors: ...


class MultiModalBatchedField(BaseMultiModalField):
    """Item i is `data[i]`."""

    def build_elems(self, modality, key, data):
        return [MultiModalFieldElem(modality, key, item, self) for item in data]

    def reduce_data(self, elems):
        return _stack_or_list([e.data for e in elems])


@dataclass
class MultiModalFlatField(BaseMultiModalField):
    """Item i is `data[slices[i]]` along `dim`: items concatenated into one tensor."""

    slices: Sequence[slice]
    dim: int = 0

    def build_elems(self, modality, key, data):
        if isinstance(data, torch.Tensor):
            index = [slice(None)] * (self.dim % data.ndim)
            return [MultiModalFieldElem(modality, key, data[(*index, s)], self) for s in self.slices]
        return [MultiModalFieldElem(modality, key, data[s], self) for s in self.slices]

    def reduce_data(self, elems):
        return _stack_or_list([e.data for e in elems], cat_dim=self.dim)


@dataclass
class MultiModalSharedField(BaseMultiModalField):
    """The same data belongs to every one of `batch_size` items."""

    batch_size: int

    def build_elems(self, modality, key, data):
        return [MultiModalFieldElem(modality, key, data, self)] * self.batch_size

    def reduce_data(self, elems):
        return elems[0].data


class MultiModalFieldConfig:
    """Schema of one HF processor output: which modality it belongs to and how it splits."""

    @staticmethod
    def batched(modality: str) -> "MultiModalFieldConfig":
        """The first dimension indexes items, e.g. `pixel_values` of shape (num_images, C, H, W)."""
        return MultiModalFieldConfig(MultiModalBatchedField(), modality)

    @staticmethod
    def flat(modality: str, slices: Sequence[slice], dim: int = 0) -> "MultiModalFieldConfig":
        """Items are concatenated along `dim`; `slices[i]` selects item i."""
        return MultiModalFieldConfig(MultiModalFlatField(slices, dim), modality)

    @staticmethod
    def flat_from_sizes(modality: str, size_per_item: Union[torch.Tensor, Sequence[int]], dim: int = 0):
        """Like `flat`, with item i spanning `size_per_item[i]` rows."""
        sizes = [int(s) for s in size_per_item]
        ends = np.cumsum(sizes).tolist()
        slices = [slice(end - size, end) for size, end in zip(sizes, ends)]
        return MultiModalFieldConfig.flat(modality, slices, dim)

    @staticmethod
    def shared(modality: str, batch_size: int) -> "MultiModalFieldConfig":
        """Every item of the modality uses the whole tensor."""
        return MultiModalFieldConfig(MultiModalSharedField(batch_size), modality)

    def __init__(self, field: BaseMultiModalField, modality: str) -> None:
        self.field = field
        self.modality = modality

    def build_elems(self, key: str, batch: NestedTensors) -> Sequence[MultiModalFieldElem]:
        return self.field.build_elems(self.modality, key, batch)


class MultiModalKwargsItem(UserDict[str, MultiModalFieldElem]):
    """All tensors of one item (key -> elem): the unit that the processor cache stores."""

    @staticmethod
    def from_elems(elems: Sequence[MultiModalFieldElem]) -> "MultiModalKwargsItem":
        return MultiModalKwargsItem({elem.key: elem for elem in elems})

    @property
    def modality(self) -> str:
        modalities = {elem.modality for elem in self.data.values()}
        if len(modalities) != 1:
            raise ValueError(f"An item must have exactly one modality, found {sorted(modalities)}")
        return next(iter(modalities))

    def nbytes(self) -> int:
        return sum(nested_tensors_nbytes(elem.data) for elem in self.data.values())


class MultiModalKwargs(Mapping[str, NestedTensors]):
    """Keyword inputs for the model (key -> batched tensor), remembering the items they came from.

    Built from items, a key is batched on first access only: the engine batches items of many
    requests at once, so batching each request's items on its own would be wasted copying.
    """

    def __init__(self, data: Mapping[str, NestedTensors] = {}, *, items: Sequence[MultiModalKwargsItem] = ()) -> None:
        self._data: dict[str, NestedTensors] = dict(data)
        self._elems_by_key: dict[str, list[MultiModalFieldElem]] = defaultdict(list)
        self._items_by_modality: dict[str, list[MultiModalKwargsItem]] = defaultdict(list)
        for item in items:
            self._items_by_modality[item.modality].append(item)
            if not data:
                for key, elem in item.items():
                    self._elems_by_key[key].append(elem)

    @staticmethod
    def from_hf_inputs(
        hf_inputs: Mapping[str, NestedTensors], config_by_key: Mapping[str, MultiModalFieldConfig]
    ) -> "MultiModalKwargs":
        """Split HF processor outputs into items; keys without a config are dropped."""
        elems_by_key: dict[str, Sequence[MultiModalFieldElem]] = {}
        keys_by_modality: dict[str, list[str]] = defaultdict(list)
        for key, config in config_by_key.items():
            if key in hf_inputs and hf_inputs[key] is not None:
                elems_by_key[key] = config.build_elems(key, hf_inputs[key])
                keys_by_modality[config.modality].append(key)
        items = []
        for modality, keys in keys_by_modality.items():
            counts = {len(elems_by_key[k]) for k in keys}
            if len(counts) != 1:
                raise ValueError(f"Fields {keys} of modality {modality!r} disagree on the item count: {counts}")
            for i in range(counts.pop()):
                items.append(MultiModalKwargsItem.from_elems([elems_by_key[k][i] for k in keys]))
        return MultiModalKwargs.from_items(items)

    @staticmethod
    def from_items(items: Sequence[MultiModalKwargsItem]) -> "MultiModalKwargs":
        """Model inputs made of these items, in this order (across requests too)."""
        return MultiModalKwargs(items=items)

    def __getitem__(self, key: str) -> NestedTensors:
        if key not in self._data:
            elems = self._elems_by_key[key] if key in self._elems_by_key else None
            if elems is None:
                raise KeyError(key)
            self._data[key] = elems[0].field.reduce_data(elems)
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data or key in self._elems_by_key

    def __iter__(self):
        # item keys first: reading a key (which fills _data) must not reorder the keys
        return iter(dict.fromkeys([*self._elems_by_key, *self._data]))

    def __len__(self) -> int:
        return len(set(self._data) | set(self._elems_by_key))

    def __repr__(self) -> str:
        counts = {m: len(items) for m, items in self._items_by_modality.items()}
        return f"MultiModalKwargs(keys={list(self)}, items={counts})"

    @property
    def modalities(self) -> list[str]:
        return list(self._items_by_modality)

    def get_item_count(self, modality: str) -> int:
        return len(self._items_by_modality.get(modality, ()))

    def get_item(self, modality: str, item_index: int) -> MultiModalKwargsItem:
        return self._items_by_modality[modality][item_index]

    def get_items(self, modality: str) -> Sequence[MultiModalKwargsItem]:
        return self._items_by_modality.get(modality, [])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MultiModalKwargs):
            return NotImplemented
        return (
            set(self) == set(other)
            and all(nested_tensors_equal(self[k], other[k]) for k in self)
            and dict(self._items_by_modality) == dict(other._items_by_modality)
        )


class MultiModalInputs(TypedDict):
    """The processed form of one prompt with its multimodal data."""

    type: Literal["multimodal"]
    prompt: str
    """The prompt text after prompt updates (decoded from the token ids)."""

    prompt_token_ids: list[int]
    mm_kwargs: MultiModalKwargs
    """Keyword inputs for the model's `get_multimodal_embeddings`."""

    mm_hashes: Optional[dict[str, list[str]]]
    """Content hash of each item, per modality (for caches and prefix caching)."""

    mm_placeholders: dict[str, list[PlaceholderRange]]
    """Where each item's placeholder tokens are, per modality, in item order."""
