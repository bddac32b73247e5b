"""ModelRunner positions: M-RoPE models get [3, T] positions equal to HF's `get_rope_index` for the
prompt and prompt-max + 1 onwards for decode, however the scheduler cuts the prompt (chunks that split
an image, prefix-cache hits, preemption); prefix-LM models get their item spans as bidirectional."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from tessera.config import SchedulerConfig
from tessera.engine.core.block_manager import BlockManager
from tessera.engine.core.encoder_cache import EncoderCache
from tessera.engine.core.model_runner import ModelRunner
from tessera.engine.core.request import MultiModalItem, Request
from tessera.engine.core.scheduler import Scheduler
from tessera.layers.attention import PagedAttention, get_attention_metadata
from tessera.models.interfaces import SupportsMRoPE, SupportsMultiModal
from tessera.models.mrope_positions import VisionGrid, mrope_input_positions
from tessera.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from tessera.sampling_params import SamplingParams
from tests.models.test_mrope_positions import IMAGE, MERGE, TEXT, hf_rope_index

VOCAB, HIDDEN, BLOCK = 16, 4, 4


class RecordingModel(nn.Module, SupportsMultiModal, SupportsMRoPE):
    """Embeds nothing, always samples token 7; records each step's positions (and attention spans)."""

    def __init__(self, mrope: bool = True) -> None:
        super().__init__()
        self.attn = PagedAttention(1, HIDDEN, 1, 1.0)  # gives the runner a KV cache to bind
        self.supports_mrope = mrope  # type: ignore[misc]
        self.steps: list[torch.Tensor] = []
        self.spans: list[list[list[tuple[int, int]]]] = []

    def get_mrope_input_positions(self, input_tokens, mm_features):
        grids = [VisionGrid(f.mm_position.offset, tuple(f.data["image_grid_thw"].data.tolist())) for f in mm_features]
        return mrope_input_positions(len(input_tokens), grids, MERGE)

    def get_multimodal_embeddings(self, **kwargs):
        return [torch.zeros(int(grid.prod()) // MERGE**2, HIDDEN) for grid in kwargs["image_grid_thw"]]

    def get_input_embeddings(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        return torch.zeros(len(input_ids), HIDDEN)

    def forward(self, input_ids, positions, inputs_embeds=None):
        self.steps.append(positions.clone())
        self.spans.append(get_attention_metadata().bidirectional_spans)
        return inputs_embeds

    def compute_logits(self, hidden_states):
        logits = torch.zeros(len(hidden_states), VOCAB)
        logits[:, 7] = 1.0
        return logits


def image_item(name: str, offset: int, grid: list[int]) -> MultiModalItem:
    elem = MultiModalFieldElem("image", "image_grid_thw", torch.tensor(grid), MultiModalBatchedField())
    length = grid[0] * grid[1] * grid[2] // MERGE**2
    return MultiModalItem("image", name, MultiModalKwargsItem.from_elems([elem]), PlaceholderRange(offset, length))


def request(request_id: str, layout, grids, max_tokens=4) -> Request:
    """A prompt laid out as [(TEXT or IMAGE, length)], the images' grids in order."""
    tokens, items, grid_iter = [], [], iter(grids)
    for kind, length in layout:
        if kind == IMAGE:
            items.append(image_item(f"img-{len(items)}-{length}", len(tokens), next(grid_iter)))
        tokens += [3 if kind == IMAGE else 1 + len(tokens) % 2] * length
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, tokens, params, mm_items=items)


class Engine:
    """Scheduler + runner + the model, stepping as LLMEngine does; records what each request ran."""

    def __init__(self, model, *, budget=64, num_blocks=64, disable_chunked_mm_input=False):
        self.model = model
        self.blocks = BlockManager(num_blocks, BLOCK)
        self.cache = EncoderCache(256)
        config = SchedulerConfig(max_num_batched_tokens=budget, disable_chunked_mm_input=disable_chunked_mm_input)
        self.scheduler = Scheduler(config, self.blocks, self.cache, encoder_budget=256, max_model_len=512)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK, dtype=torch.float32, device="cpu")
        self.ran: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # request -> (start, end, positions)

    def run(self, *requests):
        for r in requests:
            self.scheduler.add_request(r)
        while self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            sampled, hidden = self.runner.execute(out, self.blocks, self.cache)
            offset = 0
            for step in out.scheduled:
                start, n = step.request.num_computed_tokens, step.num_new_tokens
                positions = self.model.steps[-1][..., offset : offset + n]
                self.ran.setdefault(step.request.request_id, []).append((start, start + n, positions))
                offset += n
            self.scheduler.update_from_output(out, sampled, hidden)


def expected_positions(layout, grids, num_tokens):
    """HF's prompt positions, then decode at cache position + delta (HF generate)."""
    prompt, delta = hf_rope_index(Qwen2VLModel, layout, grids, [])
    decode = (torch.arange(prompt.shape[1], num_tokens) + delta).expand(3, -1)
    return torch.cat([prompt, decode], dim=1)


LAYOUT = [(TEXT, 3), (IMAGE, 6), (TEXT, 2), (IMAGE, 8), (TEXT, 1), (IMAGE, 1), (TEXT, 4)]
GRIDS = [[1, 4, 6], [1, 8, 4], [1, 2, 2]]


def assert_positions_match_hf(engine, req, layout=LAYOUT, grids=GRIDS):
    expected = expected_positions(layout, grids, req.num_tokens)
    covered = set()
    for start, end, positions in engine.ran[req.request_id]:
        assert torch.equal(positions, expected[:, start:end]), (start, end)
        covered |= set(range(start, end))
    # every token but the last sampled one ran (a prefix-cache hit skips a prefix of the prompt)
    assert covered >= set(range(req.num_prompt_tokens, req.num_tokens - 1)) and max(covered) == req.num_tokens - 2


def test_positions_equal_hf_whole_and_chunked_through_images():
    engine = Engine(RecordingModel(), budget=5)  # 5-token chunks: both large images are split
    req = request("a", LAYOUT, GRIDS)
    engine.run(req)
    chunks = [(s, e) for s, e, _ in engine.ran["a"]]
    assert any(s < 3 + 6 < e or 3 < s < 9 for s, e in chunks)  # a chunk boundary inside the first image
    assert_positions_match_hf(engine, req)
    _, delta = engine.runner.mrope_positions["a"]  # kept until the runner hears that "a" ended
    assert delta == expected_positions(LAYOUT, GRIDS, 25)[:, :25].max() + 1 - 25
    engine.run(request("b", [(TEXT, 4)], [], max_tokens=1))  # the next step drops "a"'s positions
    assert "a" not in engine.runner.mrope_positions


def test_positions_equal_hf_batched_with_prefix_hits_and_preemption():
    engine = Engine(RecordingModel(), budget=7, num_blocks=12)
    first, second = request("a", LAYOUT, GRIDS, max_tokens=6), request("b", LAYOUT, GRIDS, max_tokens=6)
    other_layout = [(IMAGE, 4), (TEXT, 5)]
    third = request("c", other_layout, [[1, 4, 4]], max_tokens=6)
    engine.run(first, second, third)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.prefix_hits > 0  # "b" reuses "a"; "c" is recomputed
    for req in (first, second):
        assert_positions_match_hf(engine, req)
    assert_positions_match_hf(engine, third, other_layout, [[1, 4, 4]])


def test_a_preempted_request_keeps_its_positions():
    engine = Engine(RecordingModel(), budget=64, num_blocks=9)  # 36 slots: two 30-token requests cannot both stay
    reqs = [request(name, LAYOUT, GRIDS, max_tokens=6) for name in ("a", "b")]
    engine.run(*reqs)
    assert engine.scheduler.num_preemptions > 0
    for req in reqs:
        assert_positions_match_hf(engine, req)


def test_a_model_without_mrope_gets_1d_positions():
    engine = Engine(RecordingModel(mrope=False), budget=5)
    req = request("a", LAYOUT, GRIDS)
    engine.run(req)
    for start, end, positions in engine.ran["a"]:
        assert torch.equal(positions, torch.arange(start, end))
    assert engine.runner.mrope_positions == {}


def test_prefix_lm_items_are_spans_and_never_split():
    model = RecordingModel(mrope=False)
    model.is_mm_prefix_lm = True  # type: ignore[misc]
    engine = Engine(model, budget=8, disable_chunked_mm_input=True)
    req = request("a", LAYOUT, GRIDS)
    engine.run(req)
    starts = [3, 11, 20]
    ends = [9, 19, 21]
    for start, end, _ in engine.ran["a"]:
        assert not any(s < end < e for s, e in zip(starts, ends))  # no chunk ends inside an image
    # each step's attention sees the spans its queries need: together, the three images
    seen = {span for step_spans in model.spans for sequence_spans in step_spans for span in sequence_spans}
    assert seen == {(3, 9), (11, 19)}  # a 1-token image needs no span: it sees itself anyway
