"""The tensor-parallel group's collectives, on two gloo ranks in one process (a thread each)."""

from __future__ import annotations

import pytest
import torch

from tessera.distributed import divide, get_tp_group, tensor_parallel_group
from tessera.distributed.parallel_state import SINGLE_RANK
from testkit.distributed import run_on_ranks, thread_groups


@pytest.fixture(scope="module")
def groups():
    return thread_groups(2)


def test_all_reduce_sums_every_rank_in_place(groups):
    def rank_sum(group):
        tensor = torch.full((3,), float(group.rank + 1))
        out = group.all_reduce(tensor)
        return out is tensor, tensor

    for same, tensor in run_on_ranks(groups, rank_sum):
        assert same and torch.equal(tensor, torch.full((3,), 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_concatenates_in_rank_order(groups, dtype):
    results = run_on_ranks(groups, lambda g: g.all_gather(torch.full((2, 2), float(g.rank), dtype=dtype), dim=-1))
    expected = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2, dtype=dtype)
    assert all(torch.equal(r, expected) for r in results)


def test_broadcast_object_sends_rank_0s_object_with_tensors(groups):
    payload = {"ids": torch.arange(5), "lists": [[1, 2], [3]], "none": None}
    results = run_on_ranks(groups, lambda g: g.broadcast_object(payload if g.rank == 0 else "ignored"))
    for result in results:
        assert (
            torch.equal(result["ids"], payload["ids"])
            and result["lists"] == payload["lists"]
            and result["none"] is None
        )


def test_a_single_rank_runs_no_collective():
    tensor = torch.ones(2)
    assert SINGLE_RANK.all_reduce(tensor) is tensor and SINGLE_RANK.all_gather(tensor) is tensor
    assert SINGLE_RANK.broadcast_object("x") == "x"


def test_layers_are_built_for_the_group_of_the_context(groups):
    assert get_tp_group() is SINGLE_RANK
    with tensor_parallel_group(groups[1]):
        assert get_tp_group() is groups[1]
    assert get_tp_group() is SINGLE_RANK


def test_divide_names_what_does_not_split():
    assert divide(8, 2, "heads") == 4
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is not divisible by tensor_parallel_size \(2\)"):
        divide(3, 2, "num_key_value_heads")
