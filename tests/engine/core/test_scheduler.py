"""Scheduler: token and encoder budgets, decode first, sequence slots, preemption and freeing.

A small harness plays the model runner and the engine: it encodes what a step asks for, checks that
everything the step reads is there (encoder outputs, KV blocks), and advances the requests.
"""

from __future__ import annotations

import torch

from tessera.config import SchedulerConfig
from tessera.engine.core.block_manager import BlockManager
from tessera.engine.core.encoder_cache import EncoderCache
from tessera.engine.core.request import MultiModalItem, Request, RequestStatus
from tessera.engine.core.scheduler import Scheduler
from tessera.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange
from tessera.sampling_params import SamplingParams

BS = 4


def make_request(request_id, num_tokens, images=(), max_tokens=2):
    """images: (content hash, offset, length). Prompts of different requests share no tokens (so no
    prefix-cache hits) unless their ids start with the same letter."""
    items = [
        MultiModalItem("image", h, MultiModalKwargsItem(), PlaceholderRange(offset, length))
        for h, offset, length in images
    ]
    tokens = [100 * ord(request_id[0]) + i for i in range(num_tokens)]
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), mm_items=items)


class Harness:
    def __init__(
        self, *, budget=64, encoder_budget=16, encoder_cache=None, num_blocks=64, max_num_seqs=64, whole_items=False,
        kv_window=None,
    ):  # fmt: skip
        self.blocks = BlockManager(num_blocks, BS)
        self.cache = EncoderCache(encoder_cache or encoder_budget)
        config = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, disable_chunked_mm_input=whole_items
        )
        self.scheduler = Scheduler(config, self.blocks, self.cache, encoder_budget, kv_window=kv_window)
        self.kv_window = kv_window
        self.encoded: list[str] = []  # item hashes, in the order the encoder ran them
        self.chunks: list[tuple[str, int, int]] = []  # (request id, start, end) of every scheduled piece

    def add(self, *requests):
        for request in requests:
            self.scheduler.add_request(request)

    def step(self):
        out = self.scheduler.schedule()
        to_encode = {item.hash: item for s in out.scheduled for item in s.encode}
        for item_hash, item in to_encode.items():
            self.cache.put(item_hash, torch.zeros(item.num_embeds, 1), out.encoder_users[item_hash])
            self.encoded.append(item_hash)
        sampled = {}
        for s in out.scheduled:
            request = s.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + s.num_new_tokens
            self.chunks.append((request.request_id, start, end))
            assert all(item.hash in self.cache.entries for item in request.items_overlapping(start, end))
            assert len(self.blocks.blocks_of(request)) * BS >= end
            released = len(self.blocks.blocks_of(request)) - len(self.blocks.live_blocks_of(request))
            first_seen = start - (self.kv_window or start + 1) + 1  # the first key the step's first query sees
            assert released * BS <= max(first_seen, 0)  # every visible key is in a live block
            if end == request.num_tokens:  # the step ends at the request's last token: it samples one
                sampled[request.request_id] = (1000 + len(request.output_token_ids), None)
        advanced = self.scheduler.update_from_output(out, sampled)
        assert [r.request_id for r in advanced] == list(sampled)
        return out

    def run(self, max_steps=200):
        outs = []
        while self.scheduler.has_unfinished_requests():
            outs.append(self.step())
            assert len(outs) < max_steps
        return outs


def planned(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_the_token_budget_is_filled_in_order_and_never_exceeded():
    harness = Harness(budget=8)
    requests = [make_request(name, 10, max_tokens=3) for name in "abc"]
    harness.add(*requests)
    outs = harness.run()
    assert planned(outs[0]) == [("a", 8)]
    assert planned(outs[1]) == [("a", 2), ("b", 6)]
    assert all(out.num_tokens <= 8 for out in outs)
    assert all(len(r.output_token_ids) == 3 and r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_running_decodes_come_before_new_prefills():
    harness = Harness(budget=8)
    first = make_request("a", 4, max_tokens=5)
    harness.add(first)
    harness.step()
    harness.add(make_request("b", 20))
    assert planned(harness.step()) == [("a", 1), ("b", 7)]
    assert planned(harness.step()) == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_the_running_requests():
    harness = Harness(max_num_seqs=2)
    requests = [make_request(name, 5, max_tokens=2) for name in "abc"]
    harness.add(*requests)
    assert [r for r, _ in planned(harness.step())] == ["a", "b"]
    assert harness.scheduler.running == requests[:2] and list(harness.scheduler.waiting) == requests[2:]
    outs = harness.run()
    assert all(len(out.scheduled) <= 2 for out in outs)
    assert "c" in [r for r, _ in planned(outs[1])]  # admitted as soon as a slot frees


# ---- images and chunked prefill --------------------------------------------------------------


def test_an_image_is_encoded_once_while_its_placeholders_span_chunks():
    harness = Harness(budget=7, encoder_budget=16)
    request = make_request("a", 30, images=[("img", 3, 16)])
    harness.add(request)
    outs = harness.run()
    assert planned(outs[0]) == [("a", 7)]  # the chunk does not stop before the image
    assert [item.hash for item in outs[0].scheduled[0].encode] == ["img"]
    assert all(not s.encode for out in outs[1:] for s in out.scheduled)
    assert harness.encoded == ["img"]
    image_chunks = [(start, end) for _, start, end in harness.chunks if start < 19 and end > 3]
    assert image_chunks == [(0, 7), (7, 14), (14, 21)]


def test_with_whole_items_a_chunk_stops_before_an_image_it_cannot_hold_whole():
    harness = Harness(budget=7, encoder_budget=16, whole_items=True)
    request = make_request("a", 30, images=[("img", 3, 6), ("big", 12, 7)])
    harness.add(request)
    harness.run()
    chunks = [(start, end) for _, start, end in harness.chunks if start < 30]
    assert chunks[:4] == [(0, 3), (3, 10), (10, 12), (12, 19)]  # each image in one chunk, text cut before it
    assert all(not (3 < end < 9 or 12 < end < 19) for _, end in chunks)


def test_with_whole_items_a_cached_prefix_inside_an_image_computes_the_rest_of_it_at_once():
    harness = Harness(budget=8, whole_items=True)
    harness.add(make_request("a", 12, images=[("img", 2, 8)], max_tokens=1))
    harness.run()
    again = make_request("a2", 12, images=[("img", 2, 8)])  # 2 full blocks cached: the hit ends inside the image
    harness.add(again)
    assert planned(harness.step()) == [("a2", 12 - 2 * BS)]


def test_a_chunk_stops_before_an_image_that_does_not_fit_the_encoder_budget_left():
    harness = Harness(budget=64, encoder_budget=16, encoder_cache=32)
    request = make_request("a", 40, images=[("one", 2, 16), ("two", 20, 16)])
    harness.add(request)
    first = harness.step()
    assert planned(first) == [("a", 20)]  # up to the second image's first placeholder
    assert [item.hash for item in first.scheduled[0].encode] == ["one"]
    second = harness.step()
    assert planned(second) == [("a", 20)]
    assert [item.hash for item in second.scheduled[0].encode] == ["two"]


def test_a_second_request_stops_before_its_image_when_the_first_used_the_encoder_budget():
    harness = Harness(budget=64, encoder_budget=16, encoder_cache=32)
    harness.add(make_request("a", 20, images=[("one", 2, 16)]), make_request("b", 24, images=[("two", 5, 16)]))
    out = harness.step()
    assert planned(out) == [("a", 20), ("b", 5)]
    assert [[item.hash for item in s.encode] for s in out.scheduled] == [["one"], []]


def test_a_request_whose_first_token_is_an_image_that_does_not_fit_waits():
    harness = Harness(budget=64, encoder_budget=16, encoder_cache=32)
    waiting = make_request("b", 20, images=[("two", 0, 16)])
    harness.add(make_request("a", 20, images=[("one", 2, 16)]), waiting)
    assert planned(harness.step()) == [("a", 20)]
    assert list(harness.scheduler.waiting) == [waiting]
    assert planned(harness.step()) == [("a", 1), ("b", 20)]


def test_a_full_encoder_cache_holds_an_image_back_like_the_budget():
    # the budget allows two images per step but the cache holds only one while it is referenced
    harness = Harness(budget=64, encoder_budget=32, encoder_cache=16)
    harness.add(make_request("a", 20, images=[("one", 2, 16)]), make_request("b", 24, images=[("two", 5, 16)]))
    assert planned(harness.step()) == [("a", 20), ("b", 5)]


def test_an_image_two_requests_need_in_one_step_is_encoded_once():
    harness = Harness(budget=64, encoder_budget=16)
    harness.add(make_request("a", 20, images=[("same", 2, 16)]), make_request("b", 20, images=[("same", 2, 16)]))
    out = harness.step()
    assert [[item.hash for item in s.encode] for s in out.scheduled] == [["same"], []]
    assert out.scheduled[1].shared == ["same"]
    assert out.encoder_users == {"same": {"a", "b"}}
    assert harness.encoded == ["same"]


# ---- preemption and finishing ------------------------------------------------------------------


def test_when_blocks_run_out_the_most_recently_admitted_request_is_preempted():
    harness = Harness(num_blocks=4)
    first, second = make_request("a", 4, max_tokens=10), make_request("b", 4, max_tokens=10)
    harness.add(first, second)
    steps = 0
    while harness.scheduler.num_preemptions == 0:
        out = harness.step()
        steps += 1
        assert steps < 20
    # both fill 2 blocks (8 tokens) and need a third: only the first (admitted earlier) gets it
    assert planned(out) == [("a", 1)]
    assert second.status == RequestStatus.WAITING and second.num_computed_tokens == 0
    assert second.num_preemptions == 1 and list(harness.scheduler.waiting) == [second]
    assert harness.blocks.blocks_of(second) == []
    assert harness.scheduler.running == [first] and len(harness.blocks.blocks_of(first)) == 3
    harness.run()
    assert len(first.output_token_ids) == len(second.output_token_ids) == 10


def test_a_request_that_cannot_grow_alone_preempts_itself():
    harness = Harness(num_blocks=2)
    request = make_request("a", 8, max_tokens=10)  # 2 blocks for the prompt, a 3rd after one decode
    harness.add(request)
    harness.step()
    out = harness.step()
    assert out.scheduled == [] and request.status == RequestStatus.WAITING
    assert harness.blocks.num_free_blocks == 2


def test_finish_frees_the_blocks_and_encoder_entries_of_a_running_request():
    harness = Harness(budget=8, encoder_budget=16)
    request = make_request("a", 30, images=[("img", 3, 16)])
    harness.add(request)
    harness.step()  # mid-prompt: holds blocks and the image
    assert harness.blocks.blocks_of(request) and harness.cache.num_referenced == 1
    harness.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert harness.blocks.num_free_blocks == harness.blocks.num_blocks
    assert harness.cache.num_referenced == 0
    assert not harness.scheduler.has_unfinished_requests()


def test_finish_removes_a_waiting_request():
    harness = Harness(max_num_seqs=1)
    running, waiting = make_request("a", 4), make_request("b", 4)
    harness.add(running, waiting)
    harness.step()
    harness.scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert list(harness.scheduler.waiting) == [] and harness.scheduler.running == [running]


def test_a_request_with_a_cached_prefix_computes_only_the_rest():
    harness = Harness()
    harness.add(make_request("a", 10, max_tokens=1))
    harness.run()
    again = make_request("a2", 10)  # same prompt tokens: 2 full blocks cached
    harness.add(again)
    assert planned(harness.step()) == [("a2", 10 - 2 * BS)]


# ---- update_from_output: what a step's sampled tokens do to request state ------------------------------------


def test_update_from_output_advances_caches_and_stops_on_eos_stop_tokens_and_length():
    harness = Harness()
    eos = Request("e", [1, 2, 3], SamplingParams(max_tokens=9), eos_token_ids=frozenset({7}))
    stop = Request("s", [4, 5, 6], SamplingParams(max_tokens=9, stop_token_ids=[8]))
    length = Request("l", [9, 10, 11], SamplingParams(max_tokens=1))
    ignoring = Request("i", [12, 13, 14], SamplingParams(max_tokens=9, ignore_eos=True), eos_token_ids=frozenset({7}))
    harness.add(eos, stop, length, ignoring)
    out = harness.scheduler.schedule()
    logprobs = {7: -0.1}
    advanced = harness.scheduler.update_from_output(
        out, {"e": (7, logprobs), "s": (8, None), "l": (5, None), "i": (7, None)}
    )
    assert [r.request_id for r in advanced] == ["e", "s", "l", "i"]
    assert all(r.num_computed_tokens == 3 and r.metrics.first_token_time is not None for r in advanced)
    assert (eos.status, eos.stop_reason, eos.output_logprobs) == (RequestStatus.FINISHED_STOPPED, None, [logprobs])
    assert (stop.status, stop.stop_reason) == (RequestStatus.FINISHED_STOPPED, 8)
    assert length.status == RequestStatus.FINISHED_LENGTH
    assert ignoring.status == RequestStatus.RUNNING and harness.scheduler.running == [ignoring]
    assert all(r.metrics.finished_time is not None for r in (eos, stop, length))
    assert harness.blocks.num_free_blocks == harness.blocks.num_blocks - 1  # only "i" holds a block


def test_the_context_length_ends_a_request():
    harness = Harness()
    harness.scheduler.max_model_len = 4
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    harness.add(request)
    harness.scheduler.update_from_output(harness.scheduler.schedule(), {"a": (5, None)})
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_tokens == 4


def test_reset_forgets_requests_cached_blocks_and_encoder_outputs():
    harness = Harness()
    harness.add(make_request("a", 10, images=[("h1", 2, 4)], max_tokens=3))
    harness.run()
    assert harness.blocks.cached_blocks and harness.cache.entries
    harness.add(make_request("b", 6))
    harness.scheduler.reset()
    assert not harness.scheduler.has_unfinished_requests() and harness.scheduler.num_preemptions == 0
    assert not harness.blocks.cached_blocks and harness.blocks.num_free_blocks == harness.blocks.num_blocks
    assert not harness.cache.entries and harness.cache.num_encoded == 0 and harness.blocks.prefix_hits == 0


# ---- a KV window ---------------------------------------------------------------------------------


def test_with_a_kv_window_blocks_before_it_are_released_after_each_step():
    harness = Harness(budget=6, kv_window=4)  # chunks of 6 tokens
    request = make_request("a", 14, max_tokens=12)
    harness.add(request)
    harness.step()  # positions 0-5: the next query (6) sees 3-6, block 0 (0-3) stays
    assert len(harness.blocks.live_blocks_of(request)) == 2
    harness.step()  # 6-11: the next (12) sees 9-12: blocks 0 and 1 (0-7) go
    assert len(harness.blocks.blocks_of(request)) == 3 and len(harness.blocks.live_blocks_of(request)) == 1
    held = []
    while harness.scheduler.has_unfinished_requests():
        harness.step()
        held.append(len(harness.blocks.live_blocks_of(request)))
    assert held[-1] == 0  # finished: all freed
    assert max(held) <= 2  # after a step, the keys a next query sees besides itself (3) span at most 2 blocks
    assert harness.blocks.num_free_blocks == 64 and harness.blocks.ref_counts == [0] * 64


def test_without_a_kv_window_every_block_is_kept():
    harness = Harness(budget=6)
    request = make_request("a", 14, max_tokens=12)
    harness.add(request)
    for _ in range(8):
        harness.step()
        assert harness.blocks.live_blocks_of(request) == harness.blocks.blocks_of(request)
    assert len(harness.blocks.blocks_of(request)) == -(-(14 + 6) // BS)


def test_a_kv_window_fits_more_sequences_in_the_same_cache():
    def preemptions(kv_window):
        harness = Harness(num_blocks=12, kv_window=kv_window)
        harness.add(*(make_request(name, 10, max_tokens=20) for name in "abcd"))  # 30 tokens = 8 blocks each
        harness.run()
        return harness.scheduler.num_preemptions

    assert preemptions(None) > 0
    assert preemptions(4) == 0


def test_with_a_kv_window_a_cached_prefix_keeps_only_the_blocks_its_step_sees():
    harness = Harness(kv_window=4)
    harness.add(make_request("a", 20, max_tokens=1))
    harness.run()
    again = make_request("a2", 20)  # same tokens: blocks 0-3 (positions 0-15) cached, 16-19 to compute
    harness.add(again)
    out = harness.scheduler.schedule()
    assert planned(out) == [("a2", 4)]  # its first query, at 16, sees 13-16: blocks 0-2 go back at once
    blocks = harness.blocks
    assert len(blocks.blocks_of(again)) == 5 and len(blocks.live_blocks_of(again)) == 2
    assert blocks.num_free_blocks == 64 - 2
    harness.scheduler.update_from_output(out, {"a2": (1, None)})
    assert blocks.prefix_hits == 16
