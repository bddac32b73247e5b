"""Loading tiny Hugging Face folders: classes, weights, sharding, pickle, renames, ties and placement.

Every expectation is read from the checkpoint files themselves; session fixture folders are copied into
tmp_path before anything in them is changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera import ModelRegistry
from tessera.config import ModelConfig
from tessera.models.fuyu import FuyuForCausalLM
from tessera.models.llava import LlavaForConditionalGeneration
from tessera.models.loader import load_model, load_weights

WEIGHTS = "model.safetensors"
MODELS = {"llava": LlavaForConditionalGeneration, "fuyu": FuyuForCausalLM}

# transformers >= 4.52 nests the parts under "model." (written out here, independently of the loader).
NEW_STYLE_PREFIXES = {
    "llava": {
        "language_model.model.": "model.language_model.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
        "language_model.lm_head.": "lm_head.",
    },
    "fuyu": {
        "language_model.model.": "model.language_model.",
        "vision_embed_tokens.": "model.vision_embed_tokens.",
        "language_model.lm_head.": "lm_head.",
    },
}


@pytest.fixture(params=list(MODELS))
def name(request):
    return request.param


@pytest.fixture
def source_dir(name, request):
    """The session fixture folder, read-only."""
    return Path(request.getfixturevalue(f"tiny_{name}_dir"))


@pytest.fixture
def folder(source_dir, tmp_path):
    """A private copy of the checkpoint folder, free to modify."""
    return Path(shutil.copytree(source_dir, tmp_path / source_dir.name))


@pytest.fixture
def llava_folder(tiny_llava_dir, tmp_path):
    return Path(shutil.copytree(tiny_llava_dir, tmp_path / "llava"))


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / WEIGHTS)


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], file: str = WEIGHTS) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / file, metadata={"format": "pt"})


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def load(folder: Path, **kwargs) -> torch.nn.Module:
    return load_model(ModelConfig(str(folder), device="cpu", **kwargs))


# Projections the model fuses into one matmul, as (fused, checkpoint parts in row order).
FUSED = [("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))]


def fused_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors arranged as the model holds them: fused projections concatenated by rows."""
    out = dict(tensors)
    for key in tensors:
        for fused, parts in FUSED:
            if f".{parts[0]}." in key:
                names = [key.replace(f".{parts[0]}.", f".{part}.") for part in parts]
                out[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([tensors[n] for n in names])
                for n in names:
                    del out[n]
    return out


def assert_weights_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    expected = fused_layout(expected)
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert state[key].dtype == tensor.dtype, key
        assert torch.equal(state[key], tensor), key


def first_key(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return next(k for k in tensors if k.endswith(suffix))


# ---- happy path ---------------------------------------------------------------------------------------------


def test_load_model_builds_the_class_with_every_checkpoint_tensor(name, source_dir):
    model = load(source_dir)
    assert type(model) is MODELS[name]
    assert type(model).__name__ in json.loads((source_dir / "config.json").read_text())["architectures"]
    assert_weights_equal(model, read_weights(source_dir))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not any(m.training for m in model.modules())


def test_load_weights_fills_a_meta_model_in_place(name, source_dir):
    config = ModelConfig(str(source_dir), device="cpu")
    model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    with torch.device("meta"):
        model = model_cls(config.hf_config)
    load_weights(model, source_dir)
    assert not any(p.is_meta for p in model.parameters())
    assert_weights_equal(model, read_weights(source_dir))


# ---- sharded checkpoints ------------------------------------------------------------------------------------


def write_two_shards(folder: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    names = list(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for file, half in zip(files, halves):
        write_weights(folder, {k: tensors[k] for k in half}, file)
    weight_map = {k: file for file, half in zip(files, halves) for k in half}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / WEIGHTS).unlink()
    return files


def test_sharded_checkpoint_loads_identically(folder):
    original = read_weights(folder)
    write_two_shards(folder, original)
    assert_weights_equal(load(folder), original)


def test_index_naming_a_missing_shard_names_that_file(llava_folder):
    present, absent = write_two_shards(llava_folder, read_weights(llava_folder))
    (llava_folder / absent).unlink()
    with pytest.raises(ValueError, match=absent) as err:
        load(llava_folder)
    assert present not in str(err.value)


# ---- errors -------------------------------------------------------------------------------------------------


def test_missing_tensor_is_named(llava_folder):
    tensors = read_weights(llava_folder)
    missing = [k for k in tensors if k.endswith("q_proj.weight")][-1]
    del tensors[missing]
    write_weights(llava_folder, tensors)
    with pytest.raises(ValueError, match="Missing weights") as err:
        load(llava_folder)
    assert missing in str(err.value)


def test_wrong_shape_names_the_tensor_and_both_shapes(llava_folder):
    tensors = read_weights(llava_folder)
    key = first_key(tensors, "o_proj.weight")
    expected_shape = tuple(tensors[key].shape)
    wrong_shape = (expected_shape[0] + 1, expected_shape[1])
    tensors[key] = torch.zeros(wrong_shape)
    write_weights(llava_folder, tensors)
    with pytest.raises(ValueError) as err:
        load(llava_folder)
    assert key in str(err.value)
    assert str(wrong_shape) in str(err.value) and str(expected_shape) in str(err.value)


def test_unexpected_tensor_is_named(llava_folder):
    write_weights(llava_folder, {**read_weights(llava_folder), "foo.bar": torch.zeros(3)})
    with pytest.raises(ValueError, match="Unexpected weights") as err:
        load(llava_folder)
    assert "foo.bar" in str(err.value)


def test_unknown_architecture_is_named(llava_folder):
    edit_config(llava_folder, lambda c: c.update(architectures=["NotARealModelForCausalLM"]))
    with pytest.raises(ValueError, match="NotARealModelForCausalLM.*not supported"):
        load(llava_folder)


def test_folder_without_weights(llava_folder):
    (llava_folder / WEIGHTS).unlink()
    with pytest.raises(ValueError, match="No weights") as err:
        load(llava_folder)
    assert str(llava_folder) in str(err.value)


# ---- pickle -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pickle_file", ["pytorch_model.bin", "model.pt"])
def test_pickle_weights_need_allow_pickle(llava_folder, pickle_file):
    original = read_weights(llava_folder)
    torch.save(original, llava_folder / pickle_file)
    (llava_folder / WEIGHTS).unlink()

    with pytest.raises(ValueError, match="allow_pickle") as err:
        load(llava_folder)
    assert "pickle" in str(err.value).replace("allow_pickle", "") and pickle_file in str(err.value)

    assert_weights_equal(load(llava_folder, allow_pickle=True), original)


# ---- checkpoint name variants -------------------------------------------------------------------------------


def test_transformers_4_52_names_load_to_the_same_weights(name, folder):
    original = read_weights(folder)
    renames = NEW_STYLE_PREFIXES[name]

    def new_name(key: str) -> str:
        old = next(p for p in renames if key.startswith(p))  # every key has one of the old prefixes
        return renames[old] + key[len(old) :]

    renamed = {new_name(k): v for k, v in original.items()}
    assert set(renamed).isdisjoint(original)
    write_weights(folder, renamed)
    assert_weights_equal(load(folder), original)


def test_transformers_5_llava_names_load_to_the_same_weights(llava_folder):
    """5.x saves LLaVA's CLIP tower without the hub's "vision_model." level (and nests under "model.")."""
    original = read_weights(llava_folder)
    hub = "vision_tower.vision_model."
    for old, new in ((hub, "vision_tower."), (hub, "model.vision_tower.")):
        renamed = {new + k[len(old) :] if k.startswith(old) else k: v for k, v in original.items()}
        assert set(renamed) != set(original)
        write_weights(llava_folder, renamed)
        assert_weights_equal(load(llava_folder), original)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_word_embeddings_share_one_parameter(llava_folder, dtype):
    edit_config(llava_folder, lambda c: c["text_config"].update(tie_word_embeddings=True))
    tensors = read_weights(llava_folder)
    del tensors["language_model.lm_head.weight"]
    write_weights(llava_folder, tensors)

    lm = load(llava_folder, dtype=dtype).language_model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    expected = tensors["language_model.model.embed_tokens.weight"].to(getattr(torch, dtype))
    assert torch.equal(lm.lm_head.weight, expected)


@pytest.mark.parametrize(
    "buffer",
    [
        "language_model.model.layers.0.self_attn.rotary_emb.inv_freq",
        "vision_tower.vision_model.embeddings.position_ids",
    ],
)
def test_recomputed_buffers_in_the_checkpoint_are_ignored(llava_folder, buffer):
    original = read_weights(llava_folder)
    write_weights(llava_folder, {**original, buffer: torch.arange(8, dtype=torch.float32)})
    assert_weights_equal(load(llava_folder), original)


# ---- placement ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "model_name, option, part",
    [
        ("llava", "vision_dtype", "vision_tower"),
        ("llava", "projector_dtype", "multi_modal_projector"),
        ("fuyu", "vision_dtype", "vision_embed_tokens"),
    ],
)
def test_part_dtype_applies_to_that_part_only(request, model_name, option, part, dtype):
    source = Path(request.getfixturevalue(f"tiny_{model_name}_dir"))
    model = load(source, **{option: str(dtype).removeprefix("torch.")})
    checkpoint = fused_layout(read_weights(source))
    in_part = [k for k in checkpoint if k.startswith(part + ".")]
    assert in_part
    for key, tensor in model.state_dict().items():
        want = dtype if key in in_part else torch.float32
        assert tensor.dtype == want, key
        assert torch.equal(tensor, checkpoint[key].to(want)), key


@pytest.mark.parametrize("option", ["dtype", "vision_dtype", "projector_dtype"])
def test_bad_dtype_name_fails_at_config(tiny_llava_dir, option):
    with pytest.raises(ValueError, match=f"{option} 'float8'"):
        ModelConfig(str(tiny_llava_dir), device="cpu", **{option: "float8"})


def test_load_model_refuses_an_mrope_config_for_a_model_without_mrope(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from testkit import build_tiny_text_model

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    folder = build_tiny_text_model(tmp_path / "m", Qwen2ForCausalLM, Qwen2Config, rope_parameters=rope)
    with pytest.raises(ValueError, match="M-RoPE.*Qwen2ForCausalLM.*SupportsMRoPE"):
        load(folder)
