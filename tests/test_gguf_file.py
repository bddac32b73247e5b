"""tessera.gguf_file: finding a model's GGUF file, reading its tokenizer metadata, and the HF config
and tokenizer corrected to it. Tiny GGUF files written here (testkit.gguf), so these run
without a downloaded model; tests/test_real_weights.py checks SmolLM2's file."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from tessera.config import ModelConfig
from tessera.engine.chat_utils import without_template_bos
from tessera.gguf_file import (
    find_gguf_file,
    fix_gguf_config,
    fix_gguf_tokenizer,
    gguf_quantization,
    load_gguf_config,
    load_gguf_tokenizer,
    read_gguf_metadata,
)
from tessera.special_tokens import adds_special_token
from tessera.tokenizer_utils import load_tokenizer
from testkit import build_tiny_gguf
from testkit.tokenizer import CHATML_TEMPLATE

pytest.importorskip("gguf", reason="the gguf package writes and reads the test files (pip install gguf)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def plain(path):
    """What transformers alone makes of the file."""
    return (
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name),
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
    )


# ---- finding the file -------------------------------------------------------------------------------


def test_a_model_path_names_a_gguf_file_or_a_folder_holding_one(tmp_path, tiny_gguf):
    assert find_gguf_file(tiny_gguf) == tiny_gguf
    assert find_gguf_file(tiny_gguf.parent) == tiny_gguf  # the only .gguf file, no config.json
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "other.gguf").write_bytes(b"")
    assert find_gguf_file(tmp_path) is None  # a Hugging Face folder, whatever else it holds
    assert find_gguf_file(tmp_path / "nothing") is None


def test_a_folder_with_several_gguf_files_or_a_missing_file_is_refused(tmp_path):
    for name in ("model.Q4_0.gguf", "model.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files .*model.Q4_0.gguf, model.Q8_0.gguf.*pass the path"):
        find_gguf_file(tmp_path)
    with pytest.raises(ValueError, match="The GGUF file .*missing.gguf does not exist"):
        find_gguf_file(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="has no config.json; .* or a .gguf file"):
        ModelConfig(str(tmp_path / "empty-folder"))


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        read_gguf_metadata(bad)


def test_a_truncated_gguf_file_is_a_clear_error(tmp_path, tiny_gguf):
    """The header and metadata read, the tensor data is cut short: an error naming the file and why."""
    truncated = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"cut.gguf could not be read as a GGUF model .* truncated or corrupt"):
        ModelConfig(str(truncated))


# ---- metadata -----------------------------------------------------------------------------------------


def test_metadata_reads_the_tokenizer_settings(tmp_path):
    path = build_tiny_gguf(tmp_path / "m.gguf", pad_token_id=None, eot_token_id=0, add_eos_token=True)
    meta = read_gguf_metadata(path)
    assert (meta.architecture, meta.tokenizer_model, meta.vocab_size) == ("llama", "gpt2", 267)
    assert (meta.bos_token_id, meta.eos_token_id, meta.pad_token_id, meta.unk_token_id) == (1, 2, None, 0)
    assert (meta.add_bos_token, meta.add_eos_token, meta.chat_template) == (False, True, CHATML_TEMPLATE)
    assert meta.stop_token_ids == [2, 0]
    assert "blk.0.attn_q.weight" in meta.tensor_names and "output.weight" not in meta.tensor_names


# ---- config -------------------------------------------------------------------------------------------


def test_token_ids_the_file_does_not_state_are_not_the_config_class_defaults(tmp_path):
    """A Llama GGUF without bos / eos ids converts to LlamaConfig's defaults 1 and 2: tokens of
    some other vocabulary (here <|im_start|> and <|im_end|>), which the engine would stop on."""
    path = build_tiny_gguf(tmp_path / "m.gguf", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config, _ = plain(path)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)  # not in the file
    ours = load_gguf_config(path)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (None, None, None)


def test_end_of_turn_tokens_join_the_eos_ids_and_the_architecture_is_set(tmp_path):
    path = build_tiny_gguf(tmp_path / "m.gguf", eos_token_id=0, eot_token_id=2)
    config, _ = plain(path)
    assert config.eos_token_id == 0 and not getattr(config, "architectures", None)  # the eot id is not read
    ours = load_gguf_config(path)
    assert ours.eos_token_id == [0, 2] and ours.architectures == ["LlamaForCausalLM"]
    assert fix_gguf_config(ours, read_gguf_metadata(path)) == []  # nothing left to fix


def test_model_config_of_a_gguf_file(tiny_gguf):
    config = ModelConfig(str(tiny_gguf))
    assert config.gguf_file == str(tiny_gguf) and config.tokenizer == str(tiny_gguf)
    assert config.architectures == ["LlamaForCausalLM"] and config.hf_config.tie_word_embeddings
    assert config.dtype.is_floating_point and str(config.dtype) == "torch.float32"  # de-quantized weights
    assert ModelConfig(str(tiny_gguf.parent)).gguf_file == str(tiny_gguf)


WIDE = dict(hidden_size=256, intermediate_size=512)  # K-quant rows are 256 long


@pytest.mark.parametrize(
    "weight_type, expected",
    [("F32", None), ("F16", None), ("Q8_0", "int8"), ("Q6_K", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4"),
     ("Q4_K", "int4")],
)  # fmt: skip
def test_auto_quantization_keeps_the_files_bits(tmp_path, weight_type, expected):
    wide = WIDE if weight_type.endswith("_K") else {}
    path = build_tiny_gguf(tmp_path / "m.gguf", weight_type=weight_type, **wide)
    types = read_gguf_metadata(path).weight_types
    # every matrix of the file: the embedding and seven per layer (tied: no output.weight)
    hidden, inter = wide.get("hidden_size", 32), wide.get("intermediate_size", 64)
    per_layer = hidden * hidden * 2 + hidden * (hidden // 2) * 2 + 3 * hidden * inter  # q, o, k, v; gate, up, down
    assert sum(types.values()) == 267 * hidden + 2 * per_layer
    assert max(types, key=types.get) == weight_type
    assert gguf_quantization(path) == expected
    assert ModelConfig(str(path), quantization="auto").quantization == expected
    assert ModelConfig(str(path)).quantization is None  # dense unless asked: HF's de-quantized weights


def test_auto_quantization_of_a_hugging_face_folder_is_none(tiny_llava_dir):
    assert ModelConfig(str(tiny_llava_dir), quantization="auto").quantization is None
    with pytest.raises(ValueError, match="supported: int8, int4, auto"):
        ModelConfig(str(tiny_llava_dir), quantization="int3")


# ---- tokenizer ----------------------------------------------------------------------------------------


def test_a_tokenizer_that_lost_the_files_settings_gets_them_back(tiny_gguf):
    """What the issue reports of the conversion (the class's default special tokens, the file's
    add_bos ignored), done by hand to the converted tokenizer: the fix restores the file's."""
    _, tokenizer = plain(tiny_gguf)
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = "<|endoftext|>", None, "<|endoftext|>"
    tokenizer.add_bos_token = True
    tokenizer.chat_template = None
    assert tokenizer.encode("the") == [0, 86, 260]  # <|endoftext|> prepended to t, he
    changes = fix_gguf_tokenizer(tokenizer, read_gguf_metadata(tiny_gguf))
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.encode("the") == [86, 260] and tokenizer.chat_template == CHATML_TEMPLATE
    assert len(changes) == 5  # bos, eos, pad, add_bos, chat template
    assert fix_gguf_tokenizer(tokenizer, read_gguf_metadata(tiny_gguf)) == []


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (False, True), (True, True), (False, False)])
def test_the_tokenizer_adds_bos_and_eos_exactly_as_the_file_says(tmp_path, add_bos, add_eos):
    path = build_tiny_gguf(tmp_path / "m.gguf", add_bos_token=add_bos, add_eos_token=add_eos)
    tokenizer = load_gguf_tokenizer(path)
    assert (adds_special_token(tokenizer, True), adds_special_token(tokenizer, False)) == (add_bos, add_eos)
    assert tokenizer.encode("the") == [1] * add_bos + [86, 260] + [2] * add_eos


def test_load_tokenizer_of_a_gguf_model(tiny_gguf):
    tokenizer = load_tokenizer(ModelConfig(str(tiny_gguf)))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"
    )  # fmt: skip
    assert not adds_special_token(tokenizer) and tokenizer.chat_template == CHATML_TEMPLATE


def test_a_template_that_writes_bos_gets_one_bos_when_the_tokenizer_adds_it(tmp_path):
    """BOS <|endoftext|> (id 0), written by the template and added by the tokenizer (or not)."""
    template = "{{ bos_token }}" + CHATML_TEMPLATE
    settings = dict(bos_token_id=0, chat_template=template)
    adding = load_gguf_tokenizer(build_tiny_gguf(tmp_path / "a" / "m.gguf", add_bos_token=True, **settings))
    not_adding = load_gguf_tokenizer(build_tiny_gguf(tmp_path / "b" / "m.gguf", add_bos_token=False, **settings))
    messages = [{"role": "user", "content": "the"}]
    for tokenizer in (adding, not_adding):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(without_template_bos(tokenizer, rendered))
        assert ids[:2] == [0, 1]  # one BOS, then the turn's <|im_start|>
        hf_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ids == list(hf_ids)
    assert adding.encode(rendered)[:3] == [0, 0, 1]  # what tokenizing the template's text as it is gives


def test_add_bos_without_a_bos_token_adds_nothing_and_says_so(tmp_path, caplog):
    path = build_tiny_gguf(tmp_path / "m.gguf", bos_token_id=None, add_bos_token=True)
    with caplog.at_level("WARNING", logger="tessera.gguf_file"):
        tokenizer = load_gguf_tokenizer(path)
    assert tokenizer.encode("the") == [86, 260]
    assert "says add_bos_token but names no such token" in caplog.text
