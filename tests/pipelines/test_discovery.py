"""Pipeline modules dropped into a folder: discovered, listed, selected by name or model name, used
for generation; a broken module only warns; no selection is a clear error."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from tessera import LLM, SamplingParams
from tessera.pipelines import list_pipelines, load_pipeline
from tessera.pipelines.base import AbstractMultimodalPipeline
from testkit import random_images

# A third-party module as a user would write it: pipelines.py imports its pipeline lazily from a
# sibling file. The pipeline turns an image into 3 embeddings: its mean colour through a fixed
# random matrix, scaled per position.
PIPELINES_PY = """
available_pipelines = ["mean-colour"]

def get_pipeline(name, params):
    if name == "mean-colour":
        from .mean_colour import MeanColourPipeline
        return MeanColourPipeline(params)
    return None

def get_pipeline_from_model_name(model_name, params):
    return get_pipeline("mean-colour", params) if "colourful" in model_name else None
"""
MEAN_COLOUR_PY = """
import numpy as np
import torch
from tessera.pipelines import AbstractMultimodalPipeline

class MeanColourPipeline(AbstractMultimodalPipeline):
    calls = []

    def __init__(self, params):
        self.hidden = params["hidden_size"]
        self.matrix = torch.randn(3, self.hidden, generator=torch.Generator().manual_seed(0))

    @staticmethod
    def name():
        return "mean-colour"

    @staticmethod
    def image_start():
        return "<s>"

    @staticmethod
    def image_end():
        return None

    def placeholder_token_id(self):
        return self.tokenizer.unk_token_id

    def num_image_embeds(self):
        return 3

    def embed_images(self, images):
        type(self).calls.append([im.size for im in images])
        colours = torch.tensor(np.array([np.asarray(im, dtype=np.float32).mean((0, 1)) / 255 for im in images]))
        base = colours @ self.matrix
        return torch.stack([base * (k + 1) for k in range(3)], dim=1)
"""


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    (root / "colours").mkdir()
    (root / "colours" / "pipelines.py").write_text(textwrap.dedent(PIPELINES_PY))
    (root / "colours" / "mean_colour.py").write_text(textwrap.dedent(MEAN_COLOUR_PY))
    (root / "broken").mkdir()
    (root / "broken" / "pipelines.py").write_text("import a_package_that_does_not_exist\n")
    (root / "not_a_module").mkdir()  # no pipelines.py: ignored
    return root


@pytest.fixture(scope="module")
def colourful_model(llava_parts, tmp_path_factory):
    """The tiny text Llama under a folder name the plugin recognises."""
    import shutil

    folder = tmp_path_factory.mktemp("models") / "colourful-llama"
    shutil.copytree(llava_parts["text"], folder)
    return folder


def test_listing_includes_builtin_and_plugin_pipelines_and_warns_about_the_broken_one(plugins, caplog):
    with caplog.at_level(logging.WARNING):
        names = list_pipelines(plugins)
    assert "mean-colour" in names and "llava-v1.5-7b" in names
    assert "broken" in caplog.text and "a_package_that_does_not_exist" in caplog.text


def test_selected_by_name_and_by_model_name(plugins):
    by_name = load_pipeline("mean-colour", params={"hidden_size": 4}, pipelines_dir=plugins)
    by_model = load_pipeline(model_name="my-colourful-model", params={"hidden_size": 4}, pipelines_dir=plugins)
    assert isinstance(by_name, AbstractMultimodalPipeline) and by_name.name() == by_model.name() == "mean-colour"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "no model name was given"),
        ({"model_name": "plain-llama"}, "none is known for the model name 'plain-llama'"),
        ({"name": "no-such-pipeline"}, "No multimodal pipeline named 'no-such-pipeline'"),
    ],
)
def test_no_pipeline_is_a_clear_error_listing_the_available_ones(plugins, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        load_pipeline(pipelines_dir=plugins, **kwargs)
    assert "mean-colour" in str(error.value) and "llava-v1.5-7b" in str(error.value)


def test_embeddings_of_the_wrong_size_are_a_clear_error(plugins, colourful_model):
    with pytest.raises(ValueError, match="Pipeline 'mean-colour' returned embeddings of shape"):
        LLM(str(colourful_model), multimodal_pipeline="mean-colour", pipelines_dir=str(plugins),
            kv_cache_memory="64MiB", pipeline_params={"hidden_size": 7})  # fmt: skip


def test_generation_stitches_text_and_image_embeddings_in_order(plugins, colourful_model):
    """Greedy tokens equal HF generate on embeddings stitched by hand (webui's torch.cat)."""
    llm = LLM(
        str(colourful_model),
        pipelines_dir=str(plugins),
        kv_cache_memory="64MiB",
        pipeline_params={"hidden_size": AutoConfig.from_pretrained(colourful_model).hidden_size},
    )  # fmt: skip  (selected by the folder name)
    pipeline = llm.engine.core.built.model.pipeline
    assert pipeline.name() == "mean-colour"
    images = random_images([(20, 30), (32, 16)], seed=3)
    texts = ["USER: ", " and ", "\nCompare. ASSISTANT:"]
    prompt = {"prompt": "<image>".join(texts), "multi_modal_data": {"image": images}}
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert type(pipeline).calls[-1] == [im.size for im in images]

    tokenizer = AutoTokenizer.from_pretrained(colourful_model)
    hf = LlamaForCausalLM.from_pretrained(colourful_model, dtype=torch.float32)
    embed = hf.get_input_embeddings()
    start = tokenizer.encode("<s>", add_special_tokens=False)
    pieces = []
    for k, text in enumerate(texts):
        pieces.append(embed(torch.tensor(tokenizer.encode(text, add_special_tokens=k == 0))))
        if k < len(images):
            pieces.append(embed(torch.tensor(start)))
            pieces.append(pipeline.embed_images([images[k]])[0])
    inputs_embeds = torch.cat(pieces)[None]
    with torch.no_grad():
        expected = hf.generate(inputs_embeds=inputs_embeds, max_new_tokens=8, do_sample=False,
                               min_new_tokens=8, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert out.outputs[0].token_ids == expected[0].tolist()
    assert len(out.prompt_token_ids) == inputs_embeds.shape[1]
