"""FAKE ``atom.model_engine.sequence``: the fields the connector and the scheduler use."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Optional

from atom.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING_FOR_REMOTE_KVS = auto()
    WAITING = auto()
    RUNNING = auto()
    ABORTED = auto()
    FINISHED = auto()
    EXIT_ENGINE = auto()


class SequenceType(Enum):
    DUMMY = auto()
    PREFILL = auto()
    DECODE = auto()


class Sequence:
    counter = count()

    def __init__(self, token_ids: list[int], block_size: int, sampling_params: Optional[SamplingParams] = None,
                 id=None, kv_transfer_params: Optional[dict] = None, request_id: Optional[str] = None) -> None:
        sampling_params = sampling_params or SamplingParams()
        self.block_size = block_size
        self.id = id or next(Sequence.counter)
        self.external_request_id = request_id
        self.status = SequenceStatus.WAITING
        self.type = SequenceType.DUMMY
        self.token_ids = list(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.is_first_decode = False
        self.output_tokens: list[int] = []
        self.leave_reason = ""
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_output = None
        self.prefix_cache_hit_tokens = 0
        self.spec_token_ids: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_tokens.append(token_id)
        self.num_tokens += 1
