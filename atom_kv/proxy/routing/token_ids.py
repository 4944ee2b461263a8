"""A request's prompt as token ids, for routing on what engines cache (``kv_aware``, local prefill).

Sources, first that answers: the body's own token-id prompt; ``--tokenizer`` (:mod:`.hf_tokenizer`, run in a
worker thread so the event loop never waits on it); an engine's ``POST /tokenize`` (vLLM's and the reference
engine's, bounded by ``--tokenize-timeout``); else None, and the policies fall back. Each request is
counted by its source in ``atom_kv_proxy_route_token_ids_total{source}``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional, Sequence

from atom_kv.proxy.routing.hf_tokenizer import HfTokenizer

__all__ = ["PromptTokenIds", "body_token_ids"]

logger = logging.getLogger(__name__)

#: what asks an engine: (body, request id, client Authorization) -> the ids, or None
EngineTokenize = Callable[[dict, str, Optional[str]], Awaitable[Optional[list[int]]]]


def _ids(value: Any) -> Optional[list[int]]:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                                                 for t in value):
        return value
    return None


def body_token_ids(body: dict) -> Optional[list[int]]:
    """The prompt's ids when the client sent them (one list of ints, or a batch of one such list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return _ids(prompt)


class PromptTokenIds:
    """Owns the proxy's tokenizer (``--tokenizer``, optional) and finds a request's prompt ids."""

    def __init__(self, engine_tokenize: EngineTokenize, tokenizer: Optional[HfTokenizer] = None,
                 count: Optional[Callable[[str], None]] = None) -> None:
        self._engine = engine_tokenize
        self._tokenizer = tokenizer
        self._count = count or (lambda source: None)

    async def of(self, body: dict, request_id: str, auth: Optional[str]) -> Optional[Sequence[int]]:
        ids = body_token_ids(body)
        if ids is not None:
            self._count("body")
            return ids
        if self._tokenizer is not None:
            ids = await asyncio.to_thread(self._local, body)
            if ids is not None:
                self._count("tokenizer")
                return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not (len(prompt) == 1 and isinstance(prompt[0], str)):
            self._count("none")  # a batch of prompts: no one prompt to route on
            return None
        ids = await self._engine(body, request_id, auth)
        self._count("engine" if ids else "none")
        return ids or None

    def _local(self, body: dict) -> Optional[list[int]]:
        tok = self._tokenizer
        assert tok is not None
        try:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return tok.encode_prompt(prompt)
            messages = body.get("messages")
            if prompt is None and isinstance(messages, list):
                return tok.encode_chat(messages)
        except Exception:  # a tokenizer failure costs a cache miss, never the request
            logger.warning("--tokenizer failed on a prompt; the engine's /tokenize is asked instead", exc_info=True)
        return None
