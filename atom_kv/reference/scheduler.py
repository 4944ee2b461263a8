"""Continuous-batching scheduler: admission, block allocation, connector events.

States: ``WAITING`` (no blocks yet) -> ``WAITING_FOR_REMOTE_KV`` (consumer:
blocks allocated, remote KV loading) -> ``RUNNING`` (prefill, then one token
per step) -> finished. A request reserves the blocks for its prompt plus
``max_tokens`` when admitted, so a running request never stalls for blocks;
when blocks run out, new requests wait in FIFO order. A request that could
never fit is rejected up front. Blocks whose KV is lent to a remote reader
(``delay_free``) stay allocated until the connector says they are free.

Prefix caching (on unless ``enable_prefix_caching=False``): at admission a
request takes the longest run of its prompt's full blocks found in the
:class:`BlockManager`'s index (never the block of the last prompt token, so
at least one token is computed and logits exist), and only the rest is
computed, or, on a decode engine, read from the producer: the connector is
told those tokens are here (``num_computed_tokens``). Blocks enter the index
once their KV is there: computed by a step, or loaded from a producer.

An exception in one request's own processing (its admission, its token, its
end) fails that request alone (:meth:`Scheduler.fail`): it ends as an abort
does, so its blocks are freed (or, while a remote peer may still use them,
held until the connector frees them) and the connector releases what it
holds for it; its client gets a 500; every other request goes on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from atom_kv.engine_hooks import SchedulerEvents, SchedulerHooks
from atom_kv.reference.block_hash import BlockHasher
from atom_kv.reference.block_manager import BlockManager
from atom_kv.reference.faults import FaultInjector, FaultStage, InjectedFault
from atom_kv.reference.first_token import prefilled_token
from atom_kv.reference.request import Request, RequestError, RequestOutput, RequestState

__all__ = ["CacheStats", "ConnectorFinishFailed", "Scheduler", "ScheduledChunk", "SchedulerOutput"]

log = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """Tokens of one request to compute this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    #: requests that failed while being admitted (each already ended)
    failed: list[RequestOutput] = field(default_factory=list)


@dataclass
class CacheStats:
    """What the prefix cache and the KV loads did (tokens, as vLLM counts its prefix cache)."""

    queries: int = 0  # prompt tokens of admitted requests
    hits: int = 0     # of those, found in the prefix cache
    loaded_blocks: int = 0  # prompt blocks read from a producer (a decode engine)


class ConnectorFinishFailed(RuntimeError):
    """The connector raised while a request was ended; its blocks were dealt with already."""


class Scheduler:
    """Owns the request queues and the :class:`BlockManager`; calls the scheduler hooks."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        hooks: Optional[SchedulerHooks] = None,
        vocab_size: int = 256,
        faults: FaultInjector = FaultInjector(),
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        hash_seed: Optional[bytes] = None,
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, caching=enable_prefix_caching, record_events=record_events)
        self.hasher = BlockHasher(block_size, hash_seed)
        self.stats = CacheStats()
        self.faults = faults
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.hooks = hooks
        self.vocab_size = vocab_size
        self.waiting: deque[Request] = deque()
        self.waiting_remote: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.held: dict[str, list[int]] = {}  # lent to remote readers until a `free` event

    # ------------------------------------------------------------------ intake
    def check(self, req: Request) -> None:
        """Raise :class:`RequestError` if the request can never run here."""
        total = req.num_prompt + req.max_tokens
        if req.num_prompt == 0:
            raise RequestError("the prompt must not be empty", param="prompt")
        if total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({req.num_prompt} in the messages, {req.max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        need = self.blocks.blocks_for(total)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"prompt needs {need} blocks ({req.num_prompt} prompt tokens + {req.max_tokens} "
                f"max_tokens, block size {self.blocks.block_size}) but the engine has only "
                f"{self.blocks.num_blocks}",
                param="prompt",
            )

    def add(self, req: Request) -> None:
        self.check(req)
        req.state = RequestState.WAITING
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.waiting_remote) + len(self.running)

    def has_work(self) -> bool:
        """True if the next step would compute something or admit a request."""
        return bool(self.running) or (bool(self.waiting) and self._can_admit_head())

    def _can_admit_head(self) -> bool:
        if len(self.running) + len(self.waiting_remote) >= self.max_num_seqs:
            return False
        head = self.waiting[0]
        hit = self._prefix_hit(head)
        return self.blocks.can_allocate(self.blocks.blocks_for(head.num_prompt + head.max_tokens) - len(hit), hit)

    def _prefix_hit(self, req: Request) -> list[int]:
        """The cached blocks holding the longest prefix of ``req``'s prompt, short of its last token."""
        if not self.blocks.caching:
            return []
        if not req.block_keys:
            self.hasher.extend(req.block_keys, req.prompt_ids)
        return self.blocks.match(req.block_keys[: (req.num_prompt - 1) // self.blocks.block_size])

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Admit what fits, then return every running request's tokens for this step."""
        budget = self.max_num_batched_tokens - len(self.running)
        admitted = 0
        failed: list[RequestOutput] = []
        while self.waiting and self._can_admit_head():
            head = self.waiting[0]
            hit = self._prefix_hit(head)
            cached = len(hit) * self.blocks.block_size
            if admitted and head.num_prompt - cached > budget:
                break  # this step already carries a prefill; the next one waits a step
            self.waiting.popleft()
            head.block_ids = self.blocks.allocate(self.blocks.blocks_for(head.num_prompt + head.max_tokens) - len(hit),
                                                  hit)
            head.num_cached_tokens = head.num_computed = cached
            head.num_cached_blocks = len(hit)
            self.stats.queries += head.num_prompt
            self.stats.hits += cached
            head.admitted_time = time.monotonic()
            try:
                self.faults.check(FaultStage.ADMIT, head)
                if self._start_remote_load(head):
                    continue
            except Exception as exc:  # this request's failure, not the engine's
                failed.append(self.fail(head, "admission", exc, connector_saw_it=False))
                continue
            head.state = RequestState.RUNNING
            self.running[head.request_id] = head
            budget -= head.num_prompt - cached
            admitted += 1
        out = SchedulerOutput(failed=failed)
        for req in self.running.values():
            ids = req.all_ids
            out.chunks.append(
                ScheduledChunk(req.request_id, ids[req.num_computed :], req.num_computed, req.block_ids)
            )
        return out

    def _start_remote_load(self, req: Request) -> bool:
        if self.hooks is None:
            return False
        n, is_async = self.hooks.get_num_new_matched_tokens(
            req.request_id, req.num_prompt, req.kv_transfer_params, req.num_cached_tokens
        )
        if n <= 0 or not is_async:
            return False
        req.num_external_tokens = n
        self.hooks.update_state_after_alloc(req.request_id, self._prompt_blocks(req), n)
        req.state = RequestState.WAITING_FOR_REMOTE_KV
        self.waiting_remote[req.request_id] = req
        log.debug("request %s waits for %d remote tokens", req.request_id, n)
        return True

    def _prompt_blocks(self, req: Request) -> list[int]:
        return req.block_ids[: self.blocks.blocks_for(req.num_prompt)]

    def _cache_computed(self, req: Request) -> None:
        """Offer the prefix cache ``req``'s full blocks whose KV is now here (its first ``num_computed`` tokens)."""
        if not self.blocks.caching:
            return
        full = req.num_computed // self.blocks.block_size
        if full <= req.num_cached_blocks:
            return
        self.hasher.extend(req.block_keys, req.all_ids[: full * self.blocks.block_size])
        self.blocks.cache(req.block_ids, req.block_keys[:full], req.num_cached_blocks)
        req.num_cached_blocks = full

    def update_from_output(self, sampled: dict[str, int], now: float) -> list[RequestOutput]:
        """Record one sampled token per computed request; finish those that hit a stop
        string or stop token id (``finish_reason`` "stop") or ``max_tokens`` ("length")."""
        outputs = []
        for rid, token in sampled.items():
            req = self.running.get(rid)
            if req is None:
                continue  # aborted during the step
            req.num_computed = req.num_prompt + len(req.output_ids)
            self._cache_computed(req)
            outputs.append(self._append_token_or_fail(req, token, now))
        return outputs

    def _append_token_or_fail(self, req: Request, token: int, now: float) -> RequestOutput:
        try:
            return self._append_token(req, token, now)
        except Exception as exc:  # this request's failure, not the engine's
            return self.fail(req, "token handling", exc)

    def _append_token(self, req: Request, token: int, now: float) -> RequestOutput:
        """Record one new token of a running request; finish it on a stop or at ``max_tokens``."""
        rid = req.request_id
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        step = req.stopper.push(token)
        out = RequestOutput(
            rid,
            new_token_ids=step.release,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        if step.stopped:
            out.finished, out.finish_reason, out.stop_reason = True, "stop", step.stop_reason
        elif len(req.output_ids) >= req.max_tokens:
            out.new_token_ids += req.stopper.flush()
            out.finished, out.finish_reason = True, "length"
        if out.finished:
            out.kv_transfer_params = self._finish(req, aborted=False)
        return out

    # ------------------------------------------------------------------ ending
    def _finish(self, req: Request, *, aborted: bool) -> Optional[dict]:
        """Remove ``req`` from every queue and free (or lend) its blocks. Raises
        :class:`ConnectorFinishFailed` (the blocks dealt with) when the connector raised."""
        self.running.pop(req.request_id, None)
        self.waiting_remote.pop(req.request_id, None)
        req.state = RequestState.FINISHED
        delay, params, error = False, None, None
        try:
            self.faults.check(FaultStage.FINISH, req)
            if self.hooks is not None:
                # a producer's params (and the rendezvous) carry the token it sampled
                first = req.output_ids[:1] if not aborted else []
                delay, params = self.hooks.request_finished(
                    req.request_id, self._prompt_blocks(req), aborted=aborted, first_token_ids=first
                )
        except Exception as exc:
            error, params = exc, None
            delay = self._abort_after_connector_error(req)
        if delay:
            keep = self._prompt_blocks(req)
            self.blocks.free(req.block_ids[len(keep) :])
            self.held[req.request_id] = keep
            log.debug("request %s: %d blocks held for remote readers", req.request_id, len(keep))
        else:
            self.blocks.free(req.block_ids)
        req.block_ids = []
        if error is not None:
            kept = "its prompt blocks held until the connector frees them" if delay else "its blocks freed"
            raise ConnectorFinishFailed(f"the KV connector raised while it ended ({type(error).__name__}: {error}); "
                                        f"ended as an abort, {kept}") from error
        return params

    def _abort_after_connector_error(self, req: Request) -> bool:
        """The connector raised while ``req`` ended: ask it once more, as an abort (which answers
        whether it lent the blocks, and drops any handoff). True: hold the prompt's blocks until
        the connector frees them, because it lent them, or its state for them is unknown after
        a second failure."""
        if self.hooks is None:
            return False
        try:
            delay, _ = self.hooks.request_finished(req.request_id, self._prompt_blocks(req), aborted=True)
            return delay
        except Exception as again:
            log.error("request %s: the KV connector failed to abort it too (%s: %s)", req.request_id,
                      type(again).__name__, again, exc_info=again)
            return True

    def fail(self, req: Request, stage: str, exc: BaseException, *, connector_saw_it: bool = True) -> RequestOutput:
        """End ``req`` after an exception in its ``stage`` ("admission", "sampling", ...; the engine goes on): ended as
        an abort is, so its blocks are freed (or held while a peer may still use them) and the
        connector drops or releases what it holds for it. ``connector_saw_it=False`` (it failed on
        admission): the producer its ``kv_transfer_params`` name is released too (sent once).
        Returns the request's error output (500)."""
        rid = req.request_id
        detail = str(exc) if isinstance(exc, ConnectorFinishFailed) else f"{type(exc).__name__}: {exc}"
        log.error("request %s failed in %s: %s", rid, stage, detail, exc_info=_traceback_of(exc))
        if req.state is not RequestState.FINISHED:
            for i, queued in enumerate(self.waiting):
                if queued is req:
                    del self.waiting[i]
                    break
            try:
                self._finish(req, aborted=True)
            except ConnectorFinishFailed as again:
                log.error("request %s: %s", rid, again, exc_info=_traceback_of(again))
        if not connector_saw_it and self.hooks is not None:
            try:
                self.hooks.request_rejected(req.kv_transfer_params)
            except Exception:
                log.exception("request %s: could not release the producer its kv_transfer_params name", rid)
        return RequestOutput(rid, finished=True, error=f"this request failed in the engine's {stage} ({detail}); "
                             f"the engine log has the details under request id {rid}", error_status=500,
                             num_prompt_tokens=req.num_prompt, num_output_tokens=len(req.output_ids))

    def abort(self, request_id: str) -> bool:
        """Abort wherever the request is; returns False if it is unknown (already done)."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.state = RequestState.FINISHED
                if self.hooks is not None:  # the connector never saw it: it may still name a producer's KV
                    try:
                        self.hooks.request_rejected(req.kv_transfer_params)
                    except Exception:
                        log.exception("request %s: could not release the producer its kv_transfer_params name",
                                      request_id)
                return True
        found = self.running.get(request_id) or self.waiting_remote.get(request_id)
        if found is None:
            return False
        try:
            self._finish(found, aborted=True)
        except ConnectorFinishFailed as exc:
            log.error("request %s (aborted): %s", request_id, exc, exc_info=_traceback_of(exc))
        return True

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with ``message`` (the engine is going down)."""
        outs = []
        for req in [*self.waiting, *self.waiting_remote.values(), *self.running.values()]:
            outs.append(RequestOutput(req.request_id, finished=True, error=message, error_status=503))
            if self.hooks is not None:  # no read will happen here: release the producers' KV
                try:
                    self.hooks.request_rejected(req.kv_transfer_params)
                except Exception:
                    log.exception("request %s: could not release the producer its kv_transfer_params name",
                                  req.request_id)
        self.waiting.clear()
        self.waiting_remote.clear()
        self.running.clear()
        return outs

    # ------------------------------------------------------------------ connector
    def apply_events(self, events: SchedulerEvents) -> list[RequestOutput]:
        outputs = []
        for rid, tokens in events.first_tokens.items():
            # the rendezvous brought the prefill's token while the KV still loads: out it goes now
            req = self.waiting_remote.get(rid)
            token = tokens[0] if len(tokens) == 1 else None
            if req is None or req.output_ids or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                continue
            outputs.append(self._append_token_or_fail(req, token, time.monotonic()))
        for rid in events.ready:
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue
            req.kv_ready_time = time.monotonic()
            req.state = RequestState.RUNNING
            self.running[rid] = req
            bs = self.blocks.block_size
            self.stats.loaded_blocks += self.blocks.blocks_for(req.num_prompt) - req.num_cached_tokens // bs
            if req.output_ids:  # the prefill's token came with the blocks: its position is next
                req.num_computed = req.num_prompt
                self._cache_computed(req)
                continue
            first = prefilled_token(req, self.vocab_size)
            if first is not None:
                # continue from the prefill's token: the next step computes its position
                req.num_computed = req.num_prompt
                self._cache_computed(req)
                outputs.append(self._append_token_or_fail(req, first, req.kv_ready_time))
                continue
            # All prompt KV is here; recompute only the last prompt token for the first logits.
            req.num_computed = min(req.num_cached_tokens + req.num_external_tokens, req.num_prompt - 1)
            self._cache_computed(req)
        for rid in events.recompute:
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue
            log.warning("request %s: remote KV load failed; recomputing the prefill locally", rid)
            req.num_computed = req.num_cached_tokens  # the cached prefix was never written
            req.state = RequestState.RUNNING
            self.running[rid] = req
        for rid, reason in events.failed.items():
            req = self.waiting_remote.pop(rid, None) or self.running.pop(rid, None)
            if req is None:
                continue
            log.warning("request %s: remote KV load failed: %s", rid, reason)
            req.state = RequestState.FINISHED
            self.blocks.free(req.block_ids)
            req.block_ids = []
            outputs.append(RequestOutput(rid, finished=True, error=f"KV transfer failed: {reason}", error_status=502,
                                         error_side="prefill"))
        for rid in events.free:
            blocks = self.held.pop(rid, None)
            if blocks is None:
                log.debug("free event for %s with no held blocks", rid)
                continue
            self.blocks.free(blocks)
        return outputs

    def release_all_held(self) -> None:
        for blocks in self.held.values():
            self.blocks.free(blocks)
        self.held.clear()


def _traceback_of(exc: BaseException) -> Optional[BaseException]:
    """The exception whose traceback a log line should carry: the connector's own under a
    :class:`ConnectorFinishFailed`; none for an injected fault (nothing to debug)."""
    root = exc.__cause__ if isinstance(exc, ConnectorFinishFailed) and exc.__cause__ is not None else exc
    return None if isinstance(root, InjectedFault) else root
