"""A request's lifecycle inside the engine, and what the engine reports back about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from atom_kv.reference.block_hash import BlockKey
from atom_kv.reference.stopping import StopChecker

__all__ = ["RequestState", "Request", "RequestOutput", "RequestError"]


class RequestError(Exception):
    """A request the engine rejects; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class RequestState(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request: prompt, sampling settings, blocks and progress."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: Optional[int] = None
    kv_transfer_params: Optional[dict] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_external_tokens: int = 0
    #: prompt tokens found in the local prefix cache at admission (whole blocks; never the last token)
    num_cached_tokens: int = 0
    #: the prefix-cache keys of the request's full blocks (prompt, then output), as far as computed
    block_keys: list[BlockKey] = field(default_factory=list)
    #: the first blocks the prefix cache was offered (their KV computed or loaded)
    num_cached_blocks: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: Optional[float] = None  # blocks allocated
    kv_ready_time: Optional[float] = None  # consumer: every rank finished reading the remote KV
    first_token_time: Optional[float] = None
    stopper: StopChecker = field(init=False)

    def __post_init__(self) -> None:
        self.stopper = StopChecker(self.stop, self.stop_token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def spans(self) -> dict[str, float]:
        """Where the time to this request's first token went, in seconds (for ``Server-Timing``):
        ``queue`` (arrival to blocks) and ``compute`` (to the first token), or for a request
        that loaded remote KV ``admission``, ``kv_wait`` (handshake, reads, confirmation) and
        ``first_step`` (none when the prefill's token came with the blocks, before the KV was in:
        ``kv_wait`` then ends at that token). Empty before the first token."""
        admitted, first = self.admitted_time, self.first_token_time
        if admitted is None or first is None:
            return {}
        if self.kv_ready_time is not None or self.num_external_tokens > 0:
            ready = first if self.kv_ready_time is None else min(self.kv_ready_time, first)
            return {"admission": admitted - self.arrival_time, "kv_wait": ready - admitted,
                    "first_step": first - ready}
        return {"queue": admitted - self.arrival_time, "compute": first - admitted}


@dataclass
class RequestOutput:
    """What happened to a request in one engine step (sent to the HTTP side).

    ``new_token_ids`` are the tokens that may be shown now (a token that could
    begin a stop string is held back until the next one decides it);
    ``num_output_tokens`` counts every generated token, shown or not."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    error: Optional[str] = None
    error_status: int = 500
    #: the side that caused ``error`` when it is not this engine: "prefill" for a failed KV load
    error_side: Optional[str] = None
    kv_transfer_params: Optional[dict] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: prompt tokens this engine found in its own prefix cache (``usage.prompt_tokens_details.cached_tokens``)
    num_cached_tokens: int = 0
