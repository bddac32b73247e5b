"""The pickle-free messages to and from an engine core process (engine/executor/serial_utils.py): every
request and output the engine makes comes back equal, tensors bit for bit; a message can build Tessera's
own data classes and nothing else."""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.engine.core.core_io import EngineCoreOutput
from tessera.engine.core.request import RequestStatus
from tessera.engine.executor.serial_utils import decode, encode
from tessera.engine.llm_engine import core_requests
from tessera.outputs import RequestMetrics
from testkit import random_images


def test_a_processed_image_request_comes_back_equal(tiny_llava_dir):
    llm = LLM(str(tiny_llava_dir), kv_cache_memory="16MiB")
    prompt = {"prompt": "USER: <image><image>\nWhat is this? ASSISTANT:",
              "multi_modal_data": {"image": random_images([(40, 30), (24, 48)], seed=3)}}  # fmt: skip
    params = SamplingParams(max_tokens=4, n=2, seed=5, stop=["x"], structured_outputs={"choice": ["a", "b"]})
    inputs = llm.engine.process_inputs(prompt, params)
    for request in core_requests("r", inputs, params, 512, arrival_time=12.5):
        back = decode(encode(request))
        assert type(back) is type(request) and back.sampling_params == request.sampling_params
        assert (back.request_id, back.prompt_token_ids, back.arrival_time) == (
            request.request_id, request.prompt_token_ids, request.arrival_time)  # fmt: skip
        assert len(back.mm_items) == len(request.mm_items) == 2
        for ours, theirs in zip(back.mm_items, request.mm_items):
            assert (ours.modality, ours.hash, ours.placeholder) == (theirs.modality, theirs.hash, theirs.placeholder)
            assert ours.kwargs == theirs.kwargs and type(ours.kwargs) is type(theirs.kwargs)  # tensors bit for bit


def test_outputs_and_plain_values_keep_their_types():
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=2.0, num_output_tokens=2, token_times=[2.0, 2.5])
    output = EngineCoreOutput("r#1", [5, 6], [{5: -0.1, 7: -2.5}, {6: -0.3}], metrics, RequestStatus.FINISHED_STOPPED,
                              stop_reason=6)  # fmt: skip
    assert decode(encode(output)) == output
    values = {"tuple": (1, ("a", None)), "set": {1, 2}, "frozenset": frozenset({3}), "slice": slice(2, 9, 3),
              "ordered": collections.OrderedDict(b=1), "numpy": np.arange(6, dtype=np.float16).reshape(2, 3),
              "scalar": np.int64(7), "bf16": torch.randn(3, 2, dtype=torch.bfloat16).t(),
              "empty": torch.empty(0, 5, dtype=torch.int64), 3: b"raw"}  # fmt: skip
    back = decode(encode(values))
    assert back["tuple"] == (1, ("a", None)) and type(back["tuple"][1]) is tuple
    assert back["set"] == {1, 2} and back["frozenset"] == frozenset({3}) and back["slice"] == slice(2, 9, 3)
    assert back["ordered"] == {"b": 1} and back[3] == b"raw" and back["scalar"] == 7
    np.testing.assert_array_equal(back["numpy"], values["numpy"])
    assert back["numpy"].dtype == np.float16 and back["numpy"].flags.writeable
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], values["bf16"])
    assert back["empty"].shape == (0, 5) and back["empty"].dtype == torch.int64


@dataclass
class NotTessera:  # a dataclass of a module outside tessera (this test module)
    x: int = 1


class Colour(enum.Enum):
    RED = 1


@pytest.mark.parametrize("value", [lambda: 1, NotTessera(), Colour.RED, object(), np.array([object()])])
def test_what_is_not_tesseras_own_data_is_refused_when_sent(value):
    with pytest.raises(TypeError, match="cannot be sent|Python objects"):
        encode({"payload": value})


@pytest.mark.parametrize("path", ["os:system", "builtins:eval", "subprocess:Popen",
                                  "tessera.engine.executor.replica:ReplicaClient",  # Tessera's, but no data class
                                  "tessera.config:no_such_class"])  # fmt: skip
def test_a_message_naming_any_other_class_is_refused_when_read(path):
    """A crafted message (as a process on the other end of the pipe could write it) builds nothing."""
    from tessera.engine.executor import serial_utils

    crafted = msgpack.ExtType(serial_utils._OBJECT, encode([path, {"args": ["echo pwned"]}]))
    with pytest.raises((ValueError, AttributeError)):
        decode(msgpack.packb({"x": crafted}, use_bin_type=True))


def test_the_core_process_transport_does_not_use_pickle():
    from tessera.engine.executor import replica, replica_process

    for module in (replica, replica_process):
        source = Path(module.__file__).read_text()
        assert "import pickle" not in source and "pickle." not in source and "serial_utils" in source, module.__name__
