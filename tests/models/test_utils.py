"""Helpers shared by model files: flattening item embeddings and writing them over placeholders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.models.utils import (
    flatten_embeddings,
    merge_multimodal_embeddings,
    merge_multimodal_embeddings_by_mask,
    module_dtype_device,
    stack_images,
)

HIDDEN = 4
IMAGE = 9  # placeholder token id


def text_embeds(num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens * HIDDEN, dtype=torch.float32).reshape(num_tokens, HIDDEN)


def item_rows(num_rows: int) -> torch.Tensor:
    """Rows distinguishable from text_embeds (negative) and from each other."""
    return -1.0 - torch.arange(num_rows * HIDDEN, dtype=torch.float32).reshape(num_rows, HIDDEN)


def written_by_hand(inputs_embeds: torch.Tensor, mask: list[bool], rows: torch.Tensor) -> torch.Tensor:
    expected = inputs_embeds.clone()
    positions = [i for i, is_mm in enumerate(mask) if is_mm]
    for row, position in zip(rows, positions, strict=True):
        expected[position] = row
    return expected


# The same 3 rows as the forms callers pass: a 3-D tensor, or one 2-D tensor per item (list or tuple).
FORMS = {
    "3d_tensor": lambda rows: rows.reshape(3, 1, HIDDEN),
    "list_2d": lambda rows: [rows[:1], rows[1:]],
    "tuple_2d": lambda rows: (rows[:2], rows[2:]),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "placeholder, input_ids",
    [
        (IMAGE, [1, IMAGE, IMAGE, 2, IMAGE, 3]),
        ([7, IMAGE], [7, 1, IMAGE, 2, 3, 7]),
    ],
)
def test_merge_writes_rows_in_order_at_the_placeholders(form, placeholder, input_ids):
    ids = set(placeholder) if isinstance(placeholder, list) else {placeholder}
    mask = [t in ids for t in input_ids]
    inputs_embeds, rows = text_embeds(len(input_ids)), item_rows(3)
    expected = written_by_hand(inputs_embeds, mask, rows)

    out = merge_multimodal_embeddings(torch.tensor(input_ids), inputs_embeds, FORMS[form](rows), placeholder)

    assert out is inputs_embeds
    assert torch.equal(out, expected)


@pytest.mark.parametrize("form", FORMS)
def test_merge_by_mask_writes_rows_in_order_where_true(form):
    mask = [False, True, False, True, True, False]
    inputs_embeds, rows = text_embeds(len(mask)), item_rows(3)
    expected = written_by_hand(inputs_embeds, mask, rows)

    out = merge_multimodal_embeddings_by_mask(inputs_embeds, FORMS[form](rows), torch.tensor(mask))

    assert out is inputs_embeds
    assert torch.equal(out, expected)


def test_merge_casts_rows_to_the_text_dtype():
    inputs_embeds, rows = text_embeds(3), item_rows(1).double()
    out = merge_multimodal_embeddings(torch.tensor([1, IMAGE, 2]), inputs_embeds, [rows], IMAGE)
    assert out.dtype == torch.float32
    assert torch.equal(out[1], rows[0].float())


@pytest.mark.parametrize("num_rows, input_ids", [(2, [IMAGE, 1, IMAGE, IMAGE]), (4, [IMAGE, 1, IMAGE]), (1, [1, 2])])
def test_merge_count_mismatch(num_rows, input_ids):
    inputs_embeds = text_embeds(len(input_ids))
    before = inputs_embeds.clone()
    num_placeholders = input_ids.count(IMAGE)
    with pytest.raises(ValueError) as err:
        merge_multimodal_embeddings(torch.tensor(input_ids), inputs_embeds, item_rows(num_rows)[None], IMAGE)
    assert str(err.value) == f"Attempted to assign {num_rows} multimodal embeddings to {num_placeholders} placeholders"
    assert torch.equal(inputs_embeds, before)


@pytest.mark.parametrize("mask", [[True, False, True], [False, False, False]])
def test_merge_by_mask_count_mismatch(mask):
    rows = [item_rows(2), item_rows(3)]  # 5 rows in two items
    with pytest.raises(ValueError) as err:
        merge_multimodal_embeddings_by_mask(text_embeds(len(mask)), rows, torch.tensor(mask))
    assert str(err.value) == f"Attempted to assign 5 multimodal embeddings to {sum(mask)} placeholders"


def test_flatten_embeddings_keeps_item_order():
    rows = item_rows(6)
    assert torch.equal(flatten_embeddings(rows.reshape(2, 3, HIDDEN)), rows)
    assert torch.equal(flatten_embeddings([rows[:1], rows[1:4], rows[4:]]), rows)
    assert torch.equal(flatten_embeddings((rows[:2].reshape(1, 2, HIDDEN), rows[2:])), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_dtype_device_of_a_part(dtype):
    assert module_dtype_device(nn.Linear(2, 2, dtype=dtype)) == (dtype, torch.device("cpu"))


def test_module_dtype_device_reads_the_first_parameter():
    part = nn.Sequential(nn.Linear(2, 2, device="meta", dtype=torch.float16), nn.Linear(2, 2))
    assert module_dtype_device(part) == (torch.float16, torch.device("meta"))


def test_merge_rejects_an_integer_mask():
    embeds = torch.zeros(3, 2)
    with pytest.raises(TypeError, match="bool mask"):
        merge_multimodal_embeddings_by_mask(embeds, [torch.ones(1, 2)], torch.tensor([0, 0, 1]))


def test_merge_with_no_items_and_no_placeholders_is_a_no_op():
    embeds = torch.randn(3, 2)
    before = embeds.clone()
    assert merge_multimodal_embeddings(torch.tensor([5, 6, 7]), embeds, [], placeholder_token_id=9) is embeds
    torch.testing.assert_close(embeds, before)


def test_stack_images_concatenates_items_and_names_a_bad_input():
    a, b = torch.randn(1, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.equal(stack_images([a, b], "pixel_values"), torch.cat([a, b]))
    assert stack_images(b, "pixel_values") is b
    with pytest.raises(ValueError, match=r"pixel_values_videos must be \(tiles, channels"):
        stack_images(torch.randn(3, 4, 4), "pixel_values_videos", "tiles")
