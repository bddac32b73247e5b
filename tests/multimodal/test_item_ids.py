"""Items named by the caller (vLLM's `multi_modal_uuids`, or an EXIF ImageID UUID on an in-memory
image): the name is the item's cache key instead of a hash of its content."""

from __future__ import annotations

import io
import uuid

import pytest
import torch
from PIL import Image

from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.hasher import MultiModalHasher
from testkit import random_images

PROMPT = "USER: <image>\nWhat is this? <image>\nAnd this? ASSISTANT:"
make = MULTIMODAL_REGISTRY.create_processor


def with_image_id(image: Image.Image, value: object) -> Image.Image:
    image = image.copy()
    image.getexif()[Image.ExifTags.Base.ImageID] = value
    return image


def test_an_exif_image_id_uuid_stands_for_the_pixels():
    red, blue = random_images([(20, 20), (30, 10)], seed=1)
    name = uuid.UUID("550e8400-e29b-41d4-a716-446655440000")
    named_red, named_blue = with_image_id(red, name), with_image_id(blue, name)
    assert MultiModalHasher.hash_kwargs(item=named_red) == MultiModalHasher.hash_kwargs(item=named_blue)
    assert MultiModalHasher.hash_kwargs(item=named_red) != MultiModalHasher.hash_kwargs(item=red)


def test_an_image_id_that_is_not_a_uuid_object_is_ignored():
    """A decoded file's ImageID is a string (whatever a client wrote): never a cache key."""
    image = random_images([(20, 20)], seed=2)[0]
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[Image.ExifTags.Base.ImageID] = str(uuid.uuid4())
    image.save(buffer, format="PNG", exif=exif)
    decoded = Image.open(io.BytesIO(buffer.getvalue()))
    decoded.load()
    assert isinstance(decoded.getexif().get(Image.ExifTags.Base.ImageID), str)
    assert MultiModalHasher.hash_kwargs(item=decoded) == MultiModalHasher.hash_kwargs(item=image)
    as_string = with_image_id(image, "550e8400-e29b-41d4-a716-446655440000")
    assert MultiModalHasher.hash_kwargs(item=as_string) == MultiModalHasher.hash_kwargs(item=image)


def test_named_items_are_keyed_by_their_ids(tiny_llava_dir):
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    images = random_images([(40, 30), (30, 50)], seed=3)
    plain = processor.apply(PROMPT, {"image": images})
    named = processor.apply(PROMPT, {"image": images}, mm_uuids={"image": ["first", None]})
    assert named["mm_hashes"]["image"] == ["first", plain["mm_hashes"]["image"][1]]
    assert named["prompt_token_ids"] == plain["prompt_token_ids"]
    single = processor.apply("USER: <image>\nHi ASSISTANT:", {"image": images[0]}, mm_uuids={"image": "only"})
    assert single["mm_hashes"]["image"] == ["only"]


def test_processor_kwargs_make_a_named_item_hash_with_them(tiny_llava_dir):
    """The same item processed with other kwargs is another cache entry, named or not (as vLLM)."""
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    image = random_images([(40, 30)], seed=4)
    prompt = "USER: <image>\nHi ASSISTANT:"
    with_kwargs = processor.apply(prompt, {"image": image}, {"do_normalize": False}, mm_uuids={"image": ["x"]})
    other_kwargs = processor.apply(prompt, {"image": image}, {"do_normalize": True}, mm_uuids={"image": ["x"]})
    hashes = {with_kwargs["mm_hashes"]["image"][0], other_kwargs["mm_hashes"]["image"][0]}
    assert len(hashes) == 2 and "x" not in hashes


def test_the_processor_cache_trusts_the_name(tiny_llava_dir):
    """A name is a promise: a second, different image under the same id gets the first's outputs."""
    processor = make(tiny_llava_dir)
    first, second = random_images([(40, 30), (30, 50)], seed=5)
    prompt = "USER: <image>\nHi ASSISTANT:"
    a = processor.apply(prompt, {"image": first}, mm_uuids={"image": ["same"]})
    b = processor.apply(prompt, {"image": second}, mm_uuids={"image": ["same"]})
    pixels = [out["mm_kwargs"].get_item("image", 0)["pixel_values"].data for out in (a, b)]
    assert torch.equal(*pixels)
    fresh = processor.apply(prompt, {"image": second})["mm_kwargs"].get_item("image", 0)["pixel_values"].data
    assert not torch.equal(pixels[0], fresh)


@pytest.mark.parametrize("uuids", [{"image": ["a"]}, {"image": ["a", "b", "c"]}, {"image": ["a", 3]}])
def test_ids_that_do_not_match_the_items_are_refused(tiny_llava_dir, uuids):
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    with pytest.raises(ValueError, match=r"multi_modal_uuids\['image'\] must list one id"):
        processor.apply(PROMPT, {"image": random_images([(40, 30), (30, 50)], seed=6)}, mm_uuids=uuids)
