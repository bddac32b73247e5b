"""From the core's new tokens to what callers get: text (incremental detokenization), stop strings, and
one `RequestOutput` per request with its n sequences.

The core decides the stops that need no text (EOS, stop token ids, length, a grammar's end: see
`Scheduler.update_from_output`); stop strings need the text, so they are found here, and `process`
returns the sequences they ended for the front-end to stop in the core. Everything a `RequestOutput`
holds is kept here, from the core's outputs: the core may run in another thread or process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .core.core_io import EngineCoreOutput
from .core.request import RequestStatus
from .detokenizer import IncrementalDetokenizer
from .prompt import PromptInputs

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """One of a request's n outputs, as the front-end sees it."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    status: Optional[RequestStatus] = None
    stop_reason: Optional[object] = None
    pooled: Optional[Any] = None  # a pooling request's result

    @property
    def finished(self) -> bool:
        return self.status is not None


@dataclass
class _Tracked:
    inputs: PromptInputs
    sequences: list[_Sequence]
    error: Optional[str] = None
    error_status: int = 500


@dataclass
class ProcessedOutputs:
    """What one step's core outputs became."""

    outputs: list[RequestOutput]  # one per request that advanced, in order
    stopped: list[str] = field(default_factory=list)  # sequences a stop string ended: stop them in the core
    aborted: list[str] = field(default_factory=list)  # sequences of failed requests the core still runs


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Tracked] = {}  # request id -> its sequences
        self.sequences: dict[str, tuple[str, _Sequence]] = {}  # sequence id -> (request id, sequence)

    def add(self, request_id: str, inputs: PromptInputs, sequences: list[tuple[str, SamplingParams, float]]) -> None:
        """Track a request: (sequence id, sampling parameters, arrival time) for each of its n sequences."""
        tracked = _Tracked(inputs, [])
        for index, (sequence_id, params, arrival) in enumerate(sequences):
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
            sequence = _Sequence(sequence_id, index, params, detokenizer, RequestMetrics(arrival_time=arrival))
            tracked.sequences.append(sequence)
            self.sequences[sequence_id] = (request_id, sequence)
        self.requests[request_id] = tracked

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def sequence_ids(self, request_id: str, *, unfinished: bool = False) -> list[str]:
        tracked = self.requests.get(request_id)
        sequences = tracked.sequences if tracked is not None else []
        return [s.request_id for s in sequences if not (unfinished and s.finished)]

    def process(self, core_outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs; the outputs of the requests they advanced (finished ones for the
        last time, then forgotten)."""
        advanced: dict[str, None] = {}
        result = ProcessedOutputs([])
        for core_output in core_outputs:
            found = self.sequences.get(core_output.request_id)
            if found is None:  # aborted meanwhile
                continue
            request_id, sequence = found
            if sequence.finished:  # a token the core made before it heard of a stop string
                continue
            advanced[request_id] = None
            sequence.metrics = core_output.metrics
            if core_output.error is not None:  # the request fails; its other sequences end too
                others = self.sequence_ids(request_id, unfinished=True)
                result.aborted += [other for other in others if other != sequence.request_id]
                self.fail(request_id, core_output.error, core_output.error_status)
                continue
            if core_output.pooled is not None:  # a pooling request: its result, no tokens
                sequence.pooled, sequence.status = core_output.pooled, core_output.status
                continue
            try:
                if self._add_tokens(sequence, core_output):
                    result.stopped.append(sequence.request_id)
            except Exception as e:  # e.g. the detokenizer on one request's tokens: that request only
                logger.exception("Making the output of request %s failed; failing it", request_id)
                result.aborted += self.sequence_ids(request_id, unfinished=True)
                self.fail(request_id, f"The engine failed while running this request ({type(e).__name__}).", 500)
        result.outputs = [self.output(request_id) for request_id in advanced if request_id in self.requests]
        return result

    def _add_tokens(self, sequence: _Sequence, core_output: EngineCoreOutput) -> bool:
        """Detokenize the new tokens; True when a stop string ended the sequence (the core still runs it)."""
        for i, token in enumerate(core_output.new_token_ids):
            sequence.token_ids.append(token)
            if core_output.new_logprobs is not None:
                sequence.logprobs.append(core_output.new_logprobs[i])
            stop_string = sequence.detokenizer.add(token)  # the text is cut before it
            if stop_string is not None:
                sequence.detokenizer.finish(stopped_by_string=True)
                if core_output.status == RequestStatus.FINISHED_STOPPED:  # EOS or a stop id: the token's reason
                    sequence.status, sequence.stop_reason = core_output.status, core_output.stop_reason
                    return False
                sequence.status, sequence.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
                if core_output.finished:  # it also reached its length limit: the stop string is the reason
                    return False
                sequence.metrics.finished_time = time.monotonic()
                return True
        if core_output.finished:  # the stop token is not part of the text; the length limit keeps all
            sequence.detokenizer.finish(drop_last_token=core_output.status == RequestStatus.FINISHED_STOPPED)
            sequence.status, sequence.stop_reason = core_output.status, core_output.stop_reason
        return False

    def output(self, request_id: str) -> RequestOutput:
        """The request's output now; once finished, the request is forgotten."""
        tracked = self.requests[request_id]
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.text,
                token_ids=list(s.token_ids),
                finish_reason=s.status.value if s.status is not None else None,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                metrics=s.metrics,
            )
            for s in tracked.sequences
        ]
        inputs = tracked.inputs
        output = RequestOutput(request_id, inputs.prompt, list(inputs.token_ids), outputs, error=tracked.error,
                               error_status=tracked.error_status, pooled=tracked.sequences[0].pooled)  # fmt: skip
        if output.finished:
            self.forget(request_id)
        return output

    def fail(self, request_id: str, message: str, status: int = 500) -> None:
        tracked = self.requests[request_id]
        tracked.error, tracked.error_status = message, status
        for sequence in tracked.sequences:
            sequence.status = sequence.status or RequestStatus.FINISHED_ERROR

    def forget(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        for sequence in tracked.sequences if tracked is not None else []:
            self.sequences.pop(sequence.request_id, None)
