"""The offline API: prompt forms, sampling options, stops, logprobs, metrics, chat and text-only models."""

from __future__ import annotations

import base64
import re

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlamaConfig, LlamaForCausalLM
from transformers import LlavaForConditionalGeneration as HFLlava

from tessera import LLM, SamplingParams
from testkit import CHATML_TEMPLATE, build_tiny_text_model, build_tokenizer, random_images

TEXT = "USER: What is this? ASSISTANT:"
IMAGE_TEXT = "USER: <image>\nWhat is this? ASSISTANT:"


def greedy(max_tokens=10, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def make_llm(folder, **options):
    return LLM(str(folder), **{"device": "cpu", "block_size": 4, "kv_cache_memory": "8MiB", **options})


def generate_one(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return make_llm(tiny_llava_dir)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("llava")


@pytest.fixture(scope="module")
def greedy_reference(llm):
    """Greedy output of TEXT, generated once for the stop tests."""
    return generate_one(llm, TEXT, greedy(12))


# ---- prompts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["string", "token-ids", "dict-prompt", "dict-token-ids"])
def test_every_prompt_form_gives_the_same_greedy_output(llm, tokenizer, form):
    ids = tokenizer.encode(TEXT)
    forms = {
        "string": TEXT,
        "token-ids": ids,
        "dict-prompt": {"prompt": TEXT},
        "dict-token-ids": {"prompt_token_ids": ids},
    }
    reference = llm.generate(TEXT, greedy(), use_tqdm=False)[0]
    output = llm.generate(forms[form], greedy(), use_tqdm=False)[0]
    assert output.prompt_token_ids == reference.prompt_token_ids == ids
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_token_id_prompt_with_an_image_equals_the_text_prompt(llm, tokenizer):
    mm_data = {"image": random_images([(40, 30)], seed=4)}
    by_text = llm.generate({"prompt": IMAGE_TEXT, "multi_modal_data": mm_data}, greedy(), use_tqdm=False)[0]
    by_ids = llm.generate(
        {"prompt_token_ids": tokenizer.encode(IMAGE_TEXT), "multi_modal_data": mm_data}, greedy(), use_tqdm=False
    )[0]
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_outputs_come_back_in_prompt_order(llm):
    prompts = ["USER: Describe the image. ASSISTANT:", TEXT, "USER: Colour? ASSISTANT:"]
    max_tokens = [7, 1, 4]  # the second finishes first, the first last
    outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens


def test_a_sampling_params_list_of_the_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([TEXT] * 3, [greedy()] * 2, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- sampling ---------------------------------------------------------------------------------------

SEEDED = SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=8, ignore_eos=True)


def sampled(output):
    return [c.token_ids for c in output.outputs]


def test_n_gives_n_different_outputs_in_index_order(llm):
    output = llm.generate(TEXT, SEEDED, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(tokens) for tokens in sampled(output)}) == 3


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    alone = sampled(llm.generate(TEXT, SEEDED, use_tqdm=False)[0])
    assert sampled(llm.generate(TEXT, SEEDED, use_tqdm=False)[0]) == alone
    others = ["USER: Describe the image. ASSISTANT:", "USER: How many shapes are there? ASSISTANT:"]
    batch = llm.generate(
        [others[0], TEXT, others[1]],
        [SamplingParams(temperature=1.0, max_tokens=5), SEEDED, SamplingParams(n=2, seed=7, max_tokens=11)],
        use_tqdm=False,
    )
    assert sampled(batch[1]) == alone


def test_another_seed_gives_other_samples(llm):
    other = SamplingParams(n=3, seed=4321, temperature=1.0, max_tokens=8, ignore_eos=True)
    first, second = llm.generate([TEXT, TEXT], [SEEDED, other], use_tqdm=False)
    assert sampled(first) != sampled(second)


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_ends_with_length(llm, max_tokens):
    output = generate_one(llm, TEXT, greedy(max_tokens))
    assert len(output.token_ids) == max_tokens
    assert (output.finish_reason, output.stop_reason) == ("length", None)


def pick_stop_token(tokenizer, tokens):
    """Index of an output token to stop on: its first occurrence, past the start, adding text of its own
    after complete characters (so that whether its text is included shows)."""
    return next(
        k
        for k in range(2, len(tokens))
        if tokens[k] not in tokens[:k]
        and not tokenizer.decode(tokens[:k]).endswith("\ufffd")
        and tokenizer.decode(tokens[: k + 1]) != tokenizer.decode(tokens[:k])
    )


def test_a_stop_token_ends_the_output_with_stop(llm, tokenizer, greedy_reference):
    tokens = greedy_reference.token_ids
    k = pick_stop_token(tokenizer, tokens)
    output = generate_one(llm, TEXT, greedy(12, stop_token_ids=[tokens[k]]))
    assert output.token_ids == tokens[: k + 1]  # included in the token ids
    assert (output.finish_reason, output.stop_reason) == ("stop", tokens[k])


def test_a_stop_token_is_not_in_the_text(llm, tokenizer, greedy_reference):
    tokens = greedy_reference.token_ids
    k = pick_stop_token(tokenizer, tokens)
    output = generate_one(llm, TEXT, greedy(12, stop_token_ids=[tokens[k]]))
    assert output.text == tokenizer.decode(tokens[:k])


def test_a_stop_string_ends_the_text_before_it(llm, tokenizer, greedy_reference):
    text, tokens = greedy_reference.text, greedy_reference.token_ids
    assert text == tokenizer.decode(tokens)
    words = [m for m in re.finditer(r"[A-Za-z0-9]{2,}", text) if m.start() > len(text) // 3]
    stop = words[0].group()  # a word that the greedy output really contains, not at its start
    output = generate_one(llm, TEXT, greedy(12, stop=stop))
    assert output.text == text[: text.index(stop)]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    # generation stopped at the token that completed the stop string
    end = next(k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    assert output.token_ids == tokens[:end]


def test_logprobs_are_log_softmax_of_the_model_logits(llm, tiny_llava_dir):
    output = llm.generate(TEXT, greedy(5, logprobs=2), use_tqdm=False)[0]
    completion = output.outputs[0]
    hf_model = HFLlava.from_pretrained(tiny_llava_dir).eval()
    ids = torch.tensor([output.prompt_token_ids + completion.token_ids[:-1]])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(input_ids=ids).logits[0].float(), dim=-1)
    logprobs = logprobs[len(output.prompt_token_ids) - 1 :]  # the positions that predicted each output token
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top2 = logprobs[step].topk(2).indices.tolist()
        assert token == top2[0]  # greedy
        assert set(entry) == set(top2)
        for t, value in entry.items():
            assert value == pytest.approx(float(logprobs[step, t]), abs=1e-4)


def test_no_logprobs_unless_asked(llm):
    assert generate_one(llm, TEXT, greedy(3)).logprobs is None


def test_metrics_are_positive_times(llm):
    output = generate_one(llm, TEXT, greedy(4))
    metrics = output.metrics
    assert metrics.num_output_tokens == 4
    assert metrics.time_to_first_token > 0
    assert metrics.time_per_output_token > 0
    assert metrics.time_to_first_token <= metrics.finished_time - metrics.arrival_time


# ---- context length ---------------------------------------------------------------------------------

LONG = "USER: " + "What colour is the circle? " * 12 + "ASSISTANT:"


@pytest.fixture(scope="module")
def short_llm(tiny_llava_dir):
    return make_llm(tiny_llava_dir, max_model_len=64)


def test_a_prompt_longer_than_the_context_is_refused(short_llm, tokenizer):
    assert len(tokenizer.encode(LONG)) > 64
    with pytest.raises(ValueError, match="context is 64.*truncate_prompt_tokens"):
        short_llm.generate(LONG, greedy(), use_tqdm=False)
    assert not short_llm.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens(short_llm, tokenizer):
    kept = tokenizer.encode(LONG)[-40:]
    output = short_llm.generate(LONG, greedy(4, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert output.prompt_token_ids == kept
    assert output.outputs[0].token_ids == generate_one(short_llm, kept, greedy(4)).token_ids


def test_without_max_tokens_generation_runs_to_the_context_length(short_llm):
    output = short_llm.generate(LONG, greedy(None, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 64 - 40
    assert output.outputs[0].finish_reason == "length"


# ---- chat ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_image(tmp_path_factory):
    image = random_images([(40, 40)], seed=11)[0]
    path = tmp_path_factory.mktemp("chat") / "picture.png"
    image.save(path)
    return image, path


def image_part(form, path):
    if form == "data-url":
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        return {"type": "image_url", "image_url": {"url": url}}
    if form == "path":
        return {"type": "image_url", "image_url": {"url": str(path)}}
    if form == "pil":
        return {"type": "image_pil", "image_pil": Image.open(path)}
    return {"type": "image_url", "image_url": path.as_uri()}  # the url given directly, as a file:// URL


@pytest.mark.parametrize("form", ["data-url", "path", "file-url", "pil"])
def test_chat_with_an_image_equals_generate_on_the_rendered_prompt(llm, chat_image, form):
    image, path = chat_image
    messages = [{"role": "user", "content": [image_part(form, path), {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert chat.prompt == IMAGE_TEXT  # the LLaVA-1.5 template: "USER: <image>\n<text> ASSISTANT:"
    direct = llm.generate({"prompt": IMAGE_TEXT, "multi_modal_data": {"image": image}}, greedy(), use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_chat_takes_several_conversations_and_plain_string_content(llm):
    conversations = [[{"role": "user", "content": "What is this?"}], [{"role": "user", "content": "Colour?"}]]
    outputs = llm.chat(conversations, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["USER: What is this? ASSISTANT:", "USER: Colour? ASSISTANT:"]
    assert outputs[0].outputs[0].token_ids == generate_one(llm, TEXT, greedy()).token_ids


def test_chat_rejects_an_unknown_content_part(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: unsupported content part type 'file'"):
        llm.chat([{"role": "user", "content": [{"type": "file", "file": "x"}]}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"This model \(llava\) does not support audio input"):
        llm.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": "x.wav"}]}], use_tqdm=False)


def test_chat_on_a_model_without_a_chat_template_is_a_clear_error(tiny_fuyu_dir):
    fuyu = make_llm(tiny_fuyu_dir)
    with pytest.raises(ValueError, match="no chat template.*chat_template=.*generate"):
        fuyu.chat([{"role": "user", "content": "What is this?"}], use_tqdm=False)


# ---- mm_processor_kwargs and item ids -----------------------------------------------------------------


def pixels(inputs):
    return [item.kwargs["pixel_values"].data for item in inputs.mm_items]


def test_mm_processor_kwargs_of_the_llm_and_of_a_prompt_process_alike(llm, tiny_llava_dir, chat_image):
    image, _ = chat_image
    prompt = {"prompt": IMAGE_TEXT, "multi_modal_data": {"image": image}}
    configured = make_llm(tiny_llava_dir, mm_processor_kwargs={"do_normalize": False})
    from_config = configured.engine.process_inputs(prompt, greedy())
    per_prompt = llm.engine.process_inputs({**prompt, "mm_processor_kwargs": {"do_normalize": False}}, greedy())
    hf = AutoProcessor.from_pretrained(tiny_llava_dir)
    unnormalized = hf(text=IMAGE_TEXT, images=image, do_normalize=False, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels(from_config)[0], unnormalized[0]) and torch.equal(pixels(per_prompt)[0], unnormalized[0])
    assert not torch.equal(pixels(llm.engine.process_inputs(prompt, greedy()))[0], unnormalized[0])
    assert [i.hash for i in from_config.mm_items] == [i.hash for i in per_prompt.mm_items]  # one cache entry
    assert (
        generate_one(configured, prompt, greedy()).token_ids
        == generate_one(llm, {**prompt, "mm_processor_kwargs": {"do_normalize": False}}, greedy()).token_ids
    )


@pytest.fixture
def applied(llm, monkeypatch):
    """What the engine handed the processor's apply (which still runs)."""
    calls = []
    original = llm.engine.processor.apply

    def recording(prompt, mm_data, hf_processor_mm_kwargs={}, *, mm_uuids=None):
        calls.append((dict(hf_processor_mm_kwargs), mm_uuids))
        return original(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    monkeypatch.setattr(llm.engine.processor, "apply", recording)
    return calls


def test_chat_passes_image_ids_and_mm_processor_kwargs(llm, chat_image, applied):
    image, path = chat_image
    content = [{**image_part("pil", path), "uuid": "picture-1"}, {"type": "text", "text": "What is this?"}]
    messages = [{"role": "user", "content": content}]
    rendered = llm.render_chat(messages)
    assert rendered["multi_modal_uuids"] == {"image": ["picture-1"]}
    assert [item.hash for item in llm.engine.process_inputs(rendered, greedy()).mm_items] == ["picture-1"]
    applied.clear()
    chat = llm.chat(messages, greedy(), use_tqdm=False, mm_processor_kwargs={"do_normalize": True})[0]
    assert applied == [({"do_normalize": True}, {"image": ["picture-1"]})]
    direct = generate_one(llm, {"prompt": IMAGE_TEXT, "multi_modal_data": {"image": image}}, greedy())
    assert chat.outputs[0].token_ids == direct.token_ids  # an id names the item; it does not change it


def test_generate_takes_item_ids_and_refuses_ids_that_do_not_match(llm, chat_image, applied):
    image, _ = chat_image
    prompt = {"prompt": IMAGE_TEXT, "multi_modal_data": {"image": [image]}}
    generate_one(llm, {**prompt, "multi_modal_uuids": {"image": ["a"]}}, greedy(2))
    assert applied[-1] == ({}, {"image": ["a"]})
    with pytest.raises(ValueError, match=r"multi_modal_uuids\['image'\] has 2 id\(s\) for 1 image"):
        llm.generate([TEXT, {**prompt, "multi_modal_uuids": {"image": ["a", "b"]}}], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- options and text-only models -------------------------------------------------------------------


@pytest.mark.parametrize("option", ["not_an_option", "hf_config"])
def test_an_unknown_option_is_refused(tiny_llava_dir, option):
    with pytest.raises(ValueError, match=f"Unknown LLM option '{option}'"):
        LLM(str(tiny_llava_dir), **{option: 1})


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_llama"), LlamaForCausalLM, LlamaConfig)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def test_a_text_only_model_matches_hf_generate(tiny_llama_dir, tokenizer):
    prompts = ["The circle is red.", "How many squares are there?"]
    llama = make_llm(tiny_llama_dir)  # its own: a failure here must not leave requests in a shared engine
    ours = [o.outputs[0].token_ids for o in llama.generate(prompts, greedy(10), use_tqdm=False)]
    hf_model = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        assert tokens == out[0, ids.shape[1] :].tolist()


def test_a_text_only_model_refuses_images(llama):
    prompt = {"prompt": "What is this?", "multi_modal_data": {"image": random_images([(16, 16)])}}
    with pytest.raises(ValueError, match="LlamaForCausalLM is a text-only model"):
        llama.generate(prompt, greedy(), use_tqdm=False)
    assert not llama.engine.has_unfinished_requests()


def test_chat_reads_local_files_in_any_format_pil_reads(llm, tmp_path):
    """The offline caller owns its files: a TIFF (refused by the server's default policy) works."""
    image = random_images([(40, 30)], seed=2)[0]
    tiff, png = tmp_path / "a.tiff", tmp_path / "a.png"
    image.save(tiff)
    image.save(png)
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def ask(path):
        content = [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": "What is this?"}]
        return llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0].outputs[0].token_ids

    assert ask(tiff) == ask(png)


# ---- streaming: the same loop as generate ------------------------------------------------------------------


def test_stream_yields_growing_outputs_ending_with_what_generate_gives(llm):
    prompt = {
        "prompt": "USER: <image>\nWhat is this? ASSISTANT:",
        "multi_modal_data": {"image": random_images([(40, 30)], seed=8)},
    }
    outputs = list(llm.stream(prompt, greedy(6)))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    token_counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert token_counts == sorted(token_counts) and token_counts[-1] == 6
    (expected,) = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[-1].outputs[0].text == expected.outputs[0].text


def test_stopping_a_stream_early_aborts_its_request(llm):
    stream = llm.stream("USER: Tell me a long story. ASSISTANT:", greedy(50))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.block_manager.num_free_blocks == llm.engine.core.num_blocks


def test_a_model_without_a_chat_template_renders_the_last_message_plainly(tiny_fuyu_dir):
    fuyu = make_llm(tiny_fuyu_dir)
    image = random_images([(30, 20)], seed=9)[0]
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, "Hi"]}]
    with pytest.raises(ValueError, match="no chat template"):
        fuyu.render_chat(messages)
    prompt = fuyu.render_chat(
        [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "this?"}]}],
        plain_fallback=True,
    )
    assert prompt == {"prompt": "What is this?"}


def test_chat_with_a_chatml_template_renders_content_as_a_string(llama, tokenizer):
    """A text model whose template concatenates message content (SmolLM2, Qwen2.5): LLM.chat used
    to crash with "can only concatenate str (not list) to str"; now it answers what generate does
    on the prompt HF renders from string messages."""
    chatml = CHATML_TEMPLATE
    messages = [{"role": "user", "content": [{"type": "text", "text": "How many squares are there?"}]}]
    (chatted,) = llama.chat(messages, greedy(6), use_tqdm=False, chat_template=chatml)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How many squares are there?"}], chat_template=chatml, add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    (generated,) = llama.generate([rendered], greedy(6), use_tqdm=False)
    assert chatted.prompt == rendered and chatted.outputs[0].token_ids == generated.outputs[0].token_ids
