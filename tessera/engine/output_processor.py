"""From sampled tokens to what callers get: text (incremental detokenization), stop strings, and
one `RequestOutput` per request with its n sequences.

The scheduler decides stops that need no text (EOS, stop token ids, length: see
`Scheduler.update_from_output`); stop strings need the text, so they are decided here and the
engine ends those sequences in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..outputs import CompletionOutput, RequestOutput
from .detokenizer import IncrementalDetokenizer
from .prompt import PromptInputs
from .request import Request, RequestStatus


@dataclass
class _Tracked:
    inputs: PromptInputs
    children: list[Request]
    error: Optional[str] = None
    error_status: int = 500


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Tracked] = {}  # parent request id -> its sequences
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # sequence id -> its text

    def add(self, request_id: str, inputs: PromptInputs, children: list[Request]) -> None:
        self.requests[request_id] = _Tracked(inputs, children)
        for child in children:
            params = child.sampling_params
            self.detokenizers[child.request_id] = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.skip_special_tokens
            )

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def children(self, request_id: str) -> list[Request]:
        tracked = self.requests.get(request_id)
        return tracked.children if tracked is not None else []

    def add_token(self, request: Request) -> Optional[str]:
        """Detokenize the request's newest token; the stop string it completed, if any (only when
        the scheduler has not already ended the sequence by a token)."""
        detokenizer = self.detokenizers[request.request_id]
        stop_string = detokenizer.add(request.output_token_ids[-1])  # the text is cut before it
        ended_by_token = request.status == RequestStatus.FINISHED_STOPPED  # EOS or a stop token id
        if stop_string is not None:
            detokenizer.finish(stopped_by_string=True)
            return None if ended_by_token else stop_string  # a token's stop reason comes first
        if request.is_finished:  # the stop token is not part of the text; the length limit keeps all
            detokenizer.finish(drop_last_token=ended_by_token)
        return None

    def output(self, request_id: str) -> RequestOutput:
        """The request's output now; once finished, the request is forgotten."""
        tracked = self.requests[request_id]
        outputs = [
            CompletionOutput(
                index=child.index,
                text=self.detokenizers[child.request_id].text,
                token_ids=list(child.output_token_ids),
                finish_reason=child.status.value if child.is_finished else None,
                stop_reason=child.stop_reason,
                logprobs=list(child.output_logprobs) if child.sampling_params.logprobs is not None else None,
                metrics=child.metrics,
            )
            for child in tracked.children
        ]
        inputs = tracked.inputs
        output = RequestOutput(request_id, inputs.prompt, list(inputs.token_ids), outputs, error=tracked.error,
                               error_status=tracked.error_status)
        if output.finished:
            self.forget(request_id)
        return output

    def fail(self, request_id: str, message: str, status: int = 500) -> None:
        tracked = self.requests[request_id]
        tracked.error, tracked.error_status = message, status

    def forget(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        for child in tracked.children if tracked is not None else []:
            self.detokenizers.pop(child.request_id, None)
