"""`/score` and `/rerank` (also `/v1/rerank`, `/v2/rerank`), vLLM's scoring endpoints for a model served with
`--runner pooling`: each document's score against the query is the cosine of their embeddings (late interaction,
MaxSim, for a multi-vector model). Documents are texts, or content parts with images (rendered by the chat
template, as a user turn)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...layers.pooler import similarity
from .protocol import RequestMediaIOKwargs, RequestProcessorKwargs
from .serving_embedding import OpenAIServingEmbedding

Document = Union[str, list[dict[str, Any]], dict[str, Any]]  # a text, content parts, or {"content": parts}


class ScoreRequest(BaseModel):
    """vLLM's /score: `text_1` (a query, or one per document) against `text_2` (the documents)."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    text_1: Union[Document, list[Document]]
    text_2: Union[Document, list[Document]]
    dimensions: Optional[int] = Field(default=None, ge=1)
    mm_processor_kwargs: RequestProcessorKwargs = None
    media_io_kwargs: RequestMediaIOKwargs = None
    user: Optional[str] = None


class RerankRequest(BaseModel):
    """The Jina/Cohere rerank request vLLM serves: `query`, `documents`, `top_n`."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    query: Document
    documents: list[Document] = Field(min_length=1)
    top_n: Optional[int] = Field(default=None, ge=1)
    return_documents: bool = True
    mm_processor_kwargs: RequestProcessorKwargs = None
    media_io_kwargs: RequestMediaIOKwargs = None
    user: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "RerankRequest":
        if not isinstance(self.query, str) and not self.query:
            raise ValueError("query is empty.")
        return self


def _documents(value: Any) -> list[Any]:
    """One document or a list of them (a list of content parts is one document)."""
    if isinstance(value, list) and value and all(isinstance(v, dict) and "type" in v for v in value):
        return [value]
    return list(value) if isinstance(value, list) else [value]


def _parts(document: Any) -> Any:
    return document["content"] if isinstance(document, dict) and "content" in document else document


class OpenAIServingScore:
    def __init__(self, embedding: OpenAIServingEmbedding) -> None:
        self.embedding = embedding

    async def _scores(self, request: Any, queries: list[Any], documents: list[Any], prefix: str, dimensions=None):
        """(a score per document, the prompt tokens used)."""
        if len(queries) not in (1, len(documents)):
            raise ValueError(f"Send one query, or one per document: got {len(queries)} for {len(documents)}.")
        prompts = [await self.embedding.document_prompt(_parts(d), request) for d in [*queries, *documents]]
        finals = await self.embedding.pooled(prompts, dimensions, request.mm_processor_kwargs, prefix)
        vectors = [final.pooled for final in finals]
        query_vectors = vectors[: len(queries)] * (len(documents) if len(queries) == 1 else 1)
        scores = [similarity(q, d) for q, d in zip(query_vectors, vectors[len(queries) :])]
        return scores, sum(len(final.prompt_token_ids) for final in finals)

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        queries, documents = _documents(request.text_1), _documents(request.text_2)
        scores, tokens = await self._scores(request, queries, documents, "score", request.dimensions)
        return {
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.embedding.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        }  # fmt: skip

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        scores, tokens = await self._scores(request, [request.query], list(request.documents), "rerank")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or len(scores)]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                document = request.documents[i]
                result["document"] = {"text": document} if isinstance(document, str) else {"content": _parts(document)}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.embedding.model_name,
                "usage": {"total_tokens": tokens}, "results": results}  # fmt: skip
