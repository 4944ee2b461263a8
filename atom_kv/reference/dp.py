"""Data parallelism: several engine cores behind one HTTP address.

Each data-parallel (DP) rank is a whole :class:`EngineCore` (its own
scheduler, KV cache, connector and TP ranks, listening on that DP rank's
side-channel ports). A request names its rank with the ``data_parallel_rank``
body field (ATOM's routers) or the ``X-data-parallel-rank`` header (vLLM's);
without either, the rank with the fewest outstanding prompt tokens takes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from atom_kv._plural import counted
from atom_kv.config import KVTransferConfig
from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.request import Request, RequestError, RequestOutput

__all__ = ["DP_RANK_FIELD", "DP_RANK_HEADER", "DataParallelEngine", "RankLoad"]

log = logging.getLogger(__name__)

DP_RANK_FIELD = "data_parallel_rank"
DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass
class RankLoad:
    """What one DP rank has been given and not yet answered."""

    requests: int = 0
    prompt_tokens: int = 0


class DataParallelEngine:
    """Owns the engine cores of one address (one per DP rank), picks the rank
    of each request and tracks each rank's outstanding load.

    ``submit``/``abort``/``finish`` are called from the HTTP server's event
    loop; each core runs its own loop thread."""

    def __init__(self, args: EngineArgs, kv_config: Optional[KVTransferConfig],
                 on_output: Callable[[RequestOutput], None], *, dp_size: int = 1,
                 engine_id: Optional[str] = None) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.args = args
        self.dp_size = dp_size
        first = EngineCore(args, kv_config, on_output, engine_id=engine_id, dp_rank=0, dp_size=dp_size)
        # one engine id per DP rank: each is its own scheduler and transfer source
        base = first.engine_id
        if dp_size > 1:
            first.engine_id = f"{base}-dp0"
        self.cores = [first] + [
            EngineCore(args, kv_config, on_output, engine_id=f"{base}-dp{r}", dp_rank=r, dp_size=dp_size)
            for r in range(1, dp_size)
        ]
        self.engine_id = base
        self.load = [RankLoad() for _ in range(dp_size)]
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (rank, prompt tokens)
        self._next = 0  # where ties between equally loaded ranks start

    # ------------------------------------------------------------------ lifecycle
    @property
    def role(self) -> str:
        return self.cores[0].role

    @property
    def fatal(self) -> Optional[str]:
        return next((c.fatal for c in self.cores if c.fatal), None)

    @property
    def on_fatal(self) -> Optional[Callable[[str], None]]:
        return self.cores[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, callback: Optional[Callable[[str], None]]) -> None:
        for core in self.cores:
            core.on_fatal = callback

    def start(self) -> None:
        """Start every rank's core (each waits for its TP ranks)."""
        for core in self.cores:
            core.start()

    def close(self) -> None:
        for core in self.cores:
            core.close()

    def hurry(self, end_requests: bool = True) -> None:
        """Hurry every rank's shutdown (:meth:`EngineCore.hurry`)."""
        for core in self.cores:
            core.hurry(end_requests)

    # ------------------------------------------------------------------ routing
    def rank_for(self, body: Any, headers: Mapping[str, str]) -> int:
        """The DP rank a request names (body field first, then header), else the least-loaded.
        Raises :class:`RequestError` (400) naming the field and the allowed range."""
        allowed = f"0..{self.dp_size - 1}"
        raw = body.get(DP_RANK_FIELD) if isinstance(body, dict) else None
        if raw is not None:
            if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < self.dp_size:
                raise RequestError(f"`{DP_RANK_FIELD}` must be an integer in {allowed} (this engine has "
                                   f"{counted(self.dp_size, 'data-parallel rank')}), got {raw!r}", param=DP_RANK_FIELD)
            return raw
        header = headers.get(DP_RANK_HEADER)
        if header is not None:
            try:
                rank = int(header.strip())
            except ValueError:
                rank = -1
            if not 0 <= rank < self.dp_size:
                raise RequestError(f"header {DP_RANK_HEADER} must be an integer in {allowed} (this engine has "
                                   f"{counted(self.dp_size, 'data-parallel rank')}), got {header!r}", param=DP_RANK_HEADER)
            return rank
        start = self._next
        self._next = (start + 1) % self.dp_size
        order = [(start + i) % self.dp_size for i in range(self.dp_size)]
        return min(order, key=lambda r: (self.load[r].prompt_tokens, self.load[r].requests))

    # ------------------------------------------------------------------ requests
    def submit(self, req: Request, rank: int) -> None:
        """Queue ``req`` on DP rank ``rank``; raises :class:`RequestError` if it can never run there."""
        self.cores[rank].submit(req)
        self._owner[req.request_id] = (rank, req.num_prompt)
        load = self.load[rank]
        load.requests += 1
        load.prompt_tokens += req.num_prompt

    def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            self.cores[owner[0]].abort(request_id)

    def finish(self, request_id: str) -> None:
        """The HTTP side is done with ``request_id`` (answered, failed or aborted)."""
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            load = self.load[owner[0]]
            load.requests -= 1
            load.prompt_tokens -= owner[1]

    def reject(self, kv_transfer_params: Any, rank: int = 0) -> None:
        """A request refused before it was queued: release the producer KV it names."""
        self.cores[rank].reject(kv_transfer_params)

    # ------------------------------------------------------------------ state
    def snapshots(self) -> list[dict[str, Any]]:
        """Each rank's :meth:`EngineCore.snapshot` plus its outstanding load."""
        out = []
        for rank, core in enumerate(self.cores):
            snap = core.snapshot()
            snap["load_requests"] = self.load[rank].requests
            snap["load_prompt_tokens"] = self.load[rank].prompt_tokens
            out.append(snap)
        return out
