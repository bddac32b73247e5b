"""`/v1/embeddings`: OpenAI's request (texts or token ids) and vLLM's chat form (`messages` with images), answered
with one pooled vector per input by a model served with `--runner pooling`. Every input is queued at once, so the
engine batches them."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from ...engine.async_engine import all_finished
from ...errors import InputError
from ...pooling_params import PoolingParams
from ...sampling_params import SamplingParams
from .protocol import EmbeddingRequest
from .serving import OpenAIServing, with_options


class OpenAIServingEmbedding:
    def __init__(self, serving: OpenAIServing, model_name: str) -> None:
        self.serving, self.engine, self.model_name = serving, serving.engine, model_name

    async def embed(self, request: EmbeddingRequest) -> dict[str, Any]:
        if self.engine.model_config.runner != "pooling":
            raise InputError("This server generates; embeddings need a model served with --runner pooling.")
        if request.messages is not None:
            video_io = self.serving.preprocessor.media_io_for(request.media_io_kwargs, request.mm_processor_kwargs)
            prompts = [await self.serving.chat_prompt(request.messages, request.add_generation_prompt, video_io)]
        else:
            prompts = [await self.serving.completion_prompt(text) for text in request.inputs()]
        params = SamplingParams(max_tokens=1, pooling=PoolingParams(dimensions=request.dimensions))
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                prompt = with_options(prompt, mm_processor_kwargs=request.mm_processor_kwargs)
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        finals = await all_finished(streams)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(final.pooled, request.encoding_format)}
                for i, final in enumerate(finals)]  # fmt: skip
        tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _encoded(vector: Any, encoding_format: str) -> Any:
    """The vector as floats, or (OpenAI's base64 format) its float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode()
    return vector.tolist()
