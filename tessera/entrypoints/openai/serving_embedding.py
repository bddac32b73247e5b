"""`/v1/embeddings`: OpenAI's request (texts or token ids) and vLLM's chat form (`messages` with images), answered
with one pooled vector per input by a model served with `--runner pooling`. Every input is queued at once, so the
engine batches them."""

from __future__ import annotations

import base64
import uuid
from typing import Any, Optional

import numpy as np

from ...engine.async_engine import all_finished
from ...errors import InputError
from ...outputs import RequestOutput
from ...pooling_params import PoolingParams
from ...sampling_params import SamplingParams
from .protocol import EmbeddingRequest
from .serving import OpenAIServing, with_options


class OpenAIServingEmbedding:
    def __init__(self, serving: OpenAIServing, model_name: str) -> None:
        self.serving, self.engine, self.model_name = serving, serving.engine, model_name

    async def embed(self, request: EmbeddingRequest) -> dict[str, Any]:
        if request.messages is not None:
            prompts = [await self.document_prompt(request.messages, request, chat=True)]
        else:
            prompts = [await self.serving.completion_prompt(text) for text in request.inputs()]
        finals = await self.pooled(prompts, request.dimensions, request.mm_processor_kwargs, "embd")
        data = [{"object": "embedding", "index": i, "embedding": _encoded(final.pooled, request.encoding_format)}
                for i, final in enumerate(finals)]  # fmt: skip
        tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip

    async def document_prompt(self, content: Any, request: Any, *, chat: bool = False) -> Any:
        """The engine prompt of a text, or of chat messages (`chat`) / content parts with images, rendered by the
        chat template without a generation prompt unless the request asks for one."""
        if isinstance(content, str):
            return await self.serving.completion_prompt(content)
        messages = content if chat else [{"role": "user", "content": content}]
        video_io = self.serving.preprocessor.media_io_for(request.media_io_kwargs, request.mm_processor_kwargs)
        return await self.serving.chat_prompt(messages, getattr(request, "add_generation_prompt", False), video_io)

    async def pooled(
        self, prompts: list[Any], dimensions: Optional[int], mm_processor_kwargs: Any, prefix: str
    ) -> list[RequestOutput]:
        """Every prompt queued at once (the engine batches them); their finished outputs, `pooled` set."""
        if self.engine.model_config.runner != "pooling":
            raise InputError("This server generates; embeddings and scores need a model served with --runner pooling.")
        params = SamplingParams(max_tokens=1, pooling=PoolingParams(dimensions=dimensions))
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                prompt = with_options(prompt, mm_processor_kwargs=mm_processor_kwargs)
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return await all_finished(streams)


def _encoded(vector: Any, encoding_format: str) -> Any:
    """The vector as floats, or (OpenAI's base64 format) its float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode()
    return vector.tolist()
