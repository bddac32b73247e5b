"""Unit tests for tessera.multimodal.inputs: field configs, kwargs items and placeholder ranges."""

from __future__ import annotations

import pytest
import torch

from tessera.multimodal.inputs import (
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalKwargs,
    MultiModalKwargsItem,
    PlaceholderRange,
    nested_tensors_equal,
)

# ---- MultiModalFieldConfig.build_elems ---------------------------------------------------------


def test_batched_build_elems_indexes_first_dim():
    x = torch.arange(3 * 2 * 4).reshape(3, 2, 4)
    elems = MultiModalFieldConfig.batched("image").build_elems("pixel_values", x)
    assert len(elems) == 3
    for i, elem in enumerate(elems):
        assert (elem.modality, elem.key) == ("image", "pixel_values")
        assert torch.equal(elem.data, x[i])


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_build_elems_slices_along_dim(dim):
    x = torch.arange(6 * 6).reshape(6, 6)
    slices = [slice(0, 2), slice(2, 3), slice(3, 6)]
    elems = MultiModalFieldConfig.flat("image", slices, dim=dim).build_elems("patches", x)
    expected = [x[s] if dim == 0 else x[:, s] for s in slices]
    assert len(elems) == len(expected)
    for elem, want in zip(elems, expected):
        assert torch.equal(elem.data, want)


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_from_sizes_matches_hand_made_slices(dim):
    x = torch.arange(6 * 6).reshape(6, 6)
    sizes = torch.tensor([2, 1, 3])
    from_sizes = MultiModalFieldConfig.flat_from_sizes("image", sizes, dim=dim).build_elems("patches", x)
    by_hand = [x[0:2], x[2:3], x[3:6]] if dim == 0 else [x[:, 0:2], x[:, 2:3], x[:, 3:6]]
    assert [e.data.tolist() for e in from_sizes] == [t.tolist() for t in by_hand]


def test_shared_build_elems_gives_whole_tensor_to_every_item():
    x = torch.randn(2, 3)
    elems = MultiModalFieldConfig.shared("image", batch_size=4).build_elems("grid", x)
    assert len(elems) == 4
    assert all(elem.data is x for elem in elems)


# ---- reduce_data -------------------------------------------------------------------------------


def test_batched_reduce_stacks_equal_shapes():
    x = torch.randn(3, 2, 4)
    config = MultiModalFieldConfig.batched("image")
    reduced = config.field.reduce_data(list(config.build_elems("pixel_values", x)))
    assert isinstance(reduced, torch.Tensor)
    assert torch.equal(reduced, x)


def test_batched_reduce_keeps_list_for_different_shapes():
    tensors = [torch.randn(3, 4, 4), torch.randn(3, 8, 2)]
    config = MultiModalFieldConfig.batched("image")
    reduced = config.field.reduce_data(list(config.build_elems("pixel_values", tensors)))
    assert isinstance(reduced, list)
    assert len(reduced) == 2
    assert all(torch.equal(r, t) for r, t in zip(reduced, tensors))


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_reduce_concatenates_back(dim):
    x = torch.randn(6, 6)
    config = MultiModalFieldConfig.flat_from_sizes("image", [2, 1, 3], dim=dim)
    reduced = config.field.reduce_data(list(config.build_elems("patches", x)))
    assert torch.equal(reduced, x)


def test_flat_reduce_keeps_list_when_other_dims_differ():
    parts = [torch.randn(2, 5), torch.randn(3, 7)]
    config = MultiModalFieldConfig.flat("image", [slice(0, 2), slice(2, 5)])
    elems = [MultiModalFieldElem("image", "patches", p, config.field) for p in parts]
    reduced = config.field.reduce_data(elems)
    assert isinstance(reduced, list)
    assert all(torch.equal(r, p) for r, p in zip(reduced, parts))


def test_shared_reduce_returns_the_single_tensor():
    x = torch.randn(2, 3)
    config = MultiModalFieldConfig.shared("image", batch_size=3)
    assert config.field.reduce_data(list(config.build_elems("grid", x))) is x


# ---- MultiModalKwargs --------------------------------------------------------------------------

PATCH_SIZES = [1, 2, 3]


@pytest.fixture
def hf_inputs():
    return {
        "pixel_values": torch.randn(3, 3, 4, 4),
        "image_sizes": torch.tensor([[4, 4], [8, 6], [2, 10]]),
        "patches": torch.randn(sum(PATCH_SIZES), 5),
        "audio_features": torch.randn(2, 7),
        "attention_mask": torch.ones(1, 9),  # no config: dropped
    }


@pytest.fixture
def configs():
    return {
        "pixel_values": MultiModalFieldConfig.batched("image"),
        "image_sizes": MultiModalFieldConfig.batched("image"),
        "patches": MultiModalFieldConfig.flat_from_sizes("image", PATCH_SIZES),
        "audio_features": MultiModalFieldConfig.batched("audio"),
    }


@pytest.fixture
def kwargs(hf_inputs, configs):
    return MultiModalKwargs.from_hf_inputs(hf_inputs, configs)


def test_from_hf_inputs_counts_items_per_modality(kwargs):
    assert sorted(kwargs.modalities) == ["audio", "image"]
    assert kwargs.get_item_count("image") == 3
    assert kwargs.get_item_count("audio") == 2
    assert kwargs.get_item_count("video") == 0


def test_from_hf_inputs_drops_keys_without_config(kwargs):
    assert "attention_mask" not in kwargs
    assert all("attention_mask" not in item for item in kwargs.get_items("image"))


def test_from_hf_inputs_item_holds_its_slice_of_every_key(kwargs, hf_inputs):
    item = kwargs.get_item("image", 1)
    assert set(item) == {"pixel_values", "image_sizes", "patches"}
    assert item.modality == "image"
    assert torch.equal(item["pixel_values"].data, hf_inputs["pixel_values"][1])
    assert torch.equal(item["image_sizes"].data, hf_inputs["image_sizes"][1])
    assert torch.equal(item["patches"].data, hf_inputs["patches"][1:3])  # item 1 spans rows 1..2


def test_from_hf_inputs_reduces_back_to_hf_tensors(kwargs, hf_inputs):
    for key in ["pixel_values", "image_sizes", "patches", "audio_features"]:
        assert torch.equal(kwargs[key], hf_inputs[key])


def test_from_hf_inputs_rejects_disagreeing_item_counts(hf_inputs, configs):
    hf_inputs["image_sizes"] = hf_inputs["image_sizes"][:2]
    with pytest.raises(ValueError, match="disagree on the item count"):
        MultiModalKwargs.from_hf_inputs(hf_inputs, configs)


def test_round_trip_from_items(hf_inputs, configs):
    del configs["audio_features"]
    kwargs = MultiModalKwargs.from_hf_inputs(hf_inputs, configs)
    assert MultiModalKwargs.from_items(kwargs.get_items("image")) == kwargs


def test_from_items_in_new_order_reorders_tensors(kwargs, hf_inputs):
    order = [2, 0, 1]
    items = kwargs.get_items("image")
    reordered = MultiModalKwargs.from_items([items[i] for i in order])
    assert torch.equal(reordered["pixel_values"], hf_inputs["pixel_values"][order])
    assert torch.equal(reordered["image_sizes"], hf_inputs["image_sizes"][order])
    rows = [hf_inputs["patches"][3:6], hf_inputs["patches"][0:1], hf_inputs["patches"][1:3]]
    assert torch.equal(reordered["patches"], torch.cat(rows))
    assert reordered != MultiModalKwargs.from_items(items)


def test_equality_does_not_depend_on_which_keys_were_read(kwargs):
    items = kwargs.get_items("image")
    a, b = MultiModalKwargs.from_items(items), MultiModalKwargs.from_items(items)
    _ = a["patches"]
    assert a == b


def test_item_nbytes_sums_numel_times_element_size():
    kwargs = MultiModalKwargs.from_hf_inputs(
        {
            "pixel_values": torch.zeros(2, 3, 4, 4, dtype=torch.float32),
            "image_sizes": torch.zeros(2, 2, dtype=torch.int64),
            "patches": torch.zeros(2, 5, dtype=torch.float16),
        },
        {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "image_sizes": MultiModalFieldConfig.batched("image"),
            "patches": MultiModalFieldConfig.flat_from_sizes("image", [1, 1]),
        },
    )
    # per item: 3*4*4 float32 + 2 int64 + 1*5 float16
    assert kwargs.get_item("image", 0).nbytes() == 3 * 4 * 4 * 4 + 2 * 8 + 5 * 2


def test_item_nbytes_counts_lists_of_tensors():
    item = MultiModalKwargsItem.from_elems(
        MultiModalFieldConfig.shared("image", 1).build_elems("grid", [torch.zeros(3), torch.zeros(2, 2)])
    )
    assert item.nbytes() == (3 + 4) * 4


def test_item_with_two_modalities_has_no_modality():
    a = MultiModalFieldConfig.batched("image").build_elems("x", torch.zeros(1, 2))[0]
    b = MultiModalFieldConfig.batched("audio").build_elems("y", torch.zeros(1, 2))[0]
    with pytest.raises(ValueError, match="exactly one modality"):
        _ = MultiModalKwargsItem.from_elems([a, b]).modality


def test_nested_tensors_equal_checks_dtype():
    assert not nested_tensors_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


# ---- PlaceholderRange --------------------------------------------------------------------------


def test_num_embeds_without_mask_is_length():
    assert PlaceholderRange(offset=3, length=5).get_num_embeds() == 5


def test_num_embeds_with_mask_counts_true_positions():
    mask = torch.tensor([True, False, True, True, False])
    assert PlaceholderRange(offset=3, length=5, is_embed=mask).get_num_embeds() == 3


def test_placeholder_ranges_with_same_fields_are_equal():
    a = PlaceholderRange(1, 3, torch.tensor([True, False, True]))
    b = PlaceholderRange(1, 3, torch.tensor([True, False, True]))
    assert a == b
    assert PlaceholderRange(1, 3) == PlaceholderRange(1, 3)


@pytest.mark.parametrize(
    "other",
    [
        PlaceholderRange(1, 3, torch.tensor([True, True, True])),  # different mask
        PlaceholderRange(1, 3),  # no mask
        PlaceholderRange(2, 3, torch.tensor([True, False, True])),  # different offset
        PlaceholderRange(1, 4, torch.tensor([True, False, True, False])),  # different length
    ],
)
def test_placeholder_ranges_differing_in_any_field_are_unequal(other):
    assert PlaceholderRange(1, 3, torch.tensor([True, False, True])) != other


# ---- suspected bugs ----------------------------------------------------------------------------


def test_flat_field_over_list_of_tensors_round_trips():
    tensors = [torch.zeros(1, 2), torch.ones(2, 3), torch.full((1, 1), 2.0)]
    config = {"x": MultiModalFieldConfig.flat("image", [slice(0, 1), slice(1, 3)])}
    kwargs = MultiModalKwargs.from_hf_inputs({"x": tensors}, config)
    assert kwargs.get_item_count("image") == 2
    assert nested_tensors_equal(kwargs["x"], tensors)


def test_flat_negative_dim_slices_last_dim_or_is_rejected():
    x = torch.arange(3 * 4).reshape(3, 4)
    slices = [slice(0, 1), slice(1, 4)]
    try:
        elems = MultiModalFieldConfig.flat("image", slices, dim=-1).build_elems("x", x)
    except ValueError:
        return
    assert all(torch.equal(e.data, x[..., s]) for e, s in zip(elems, slices))
