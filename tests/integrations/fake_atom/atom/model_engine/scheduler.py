"""FAKE ``atom.model_engine.scheduler``: ATOM main's connector calls, nothing else.

Kept from ATOM (``Scheduler.schedule``/``postprocess``/``_update_from_kv_xfer_finished``):

- admission: an ``ABORTED`` waiting request is rejected, blocks untouched and
  the connector not told; a ``WAITING_FOR_REMOTE_KVS`` request goes to its
  first decode once ``finished_recving`` named it, back to normal admission
  once ``failed_recving`` did, else stays parked; otherwise
  ``get_num_new_matched_tokens`` -> ``allocate`` (which asserts an empty block
  table) -> ``update_state_after_alloc`` -> ``should_park_for_load_after_alloc``;
- the first decode after a load appends the producer's ``first_token_id``;
- ``build_connector_meta`` once per ``schedule`` that returns a batch;
- ``postprocess``: a request that finishes (or was aborted while running) gets
  ``request_finished`` twice when streaming; a producer's blocks wait in
  ``deferred_free_blocks`` for ``finished_sending``; a consumer's are freed
  unless ``should_defer_free``;
- ``_update_from_kv_xfer_finished`` runs ``process_completions`` first, then
  queues finished/failed receives and frees the sent requests (asserting they
  are deferred);
- KV cache events (``kv_events_config``): a load that ``finished_recving``
  named, once its request leaves ``WAITING_FOR_REMOTE_KVS``, becomes one
  ``record_remote_store`` of its full prompt blocks past
  ``num_cached_tokens`` (``Scheduler._update_waiting_for_remote_kv``; ATOM
  hashes them with its prefix cache, the fake with a FAKE chain hash);
  ``publish_kv_events`` drains the block manager's log into ``published``
  (ATOM: its ``ZmqEventPublisher``), ``shutdown_kv_events`` stops it.

Not modelled: chunked prefill, prefix caching, preemption, speculative decoding.

With ``config.upstream_connector_contract`` set, it is ATOM with the change
``docs/atom-upstream.md`` proposes instead: the connector is built with
``block_manager=``, and a request ended while waiting is reported to the
connector's ``request_finished``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import Sequence, SequenceStatus, SequenceType


class ScheduledBatch:
    def __init__(self, seqs: dict, num_scheduled_tokens: list[int], connector_meta_output: Any,
                 total_seqs_num_prefill: int, num_cached_tokens: list[int]) -> None:
        self.req_ids = list(seqs)
        self.num_scheduled_tokens = num_scheduled_tokens
        self.connector_meta_output = connector_meta_output
        self.total_seqs_num_prefill = total_seqs_num_prefill
        self.num_cached_tokens = num_cached_tokens


class ScheduledBatchOutput:
    def __init__(self, req_ids: list[int], token_ids: list[tuple[int, ...]], num_rejected: Any, num_bonus: Any,
                 draft_token_ids: Any, is_deferred_out: bool = False) -> None:
        self.req_ids = req_ids
        self.token_ids = token_ids


class Scheduler:
    def __init__(self, config: Any) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_id = config.eos_token_id
        self.block_manager = BlockManager(config)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.finished_recving_kv_req_ids: list = []
        self.failed_recving_kv_req_ids: list = []
        self.deferred_free_blocks: dict[int, Sequence] = {}
        self._rejected: list[Sequence] = []
        self._num_parked_remote_kv = 0
        self.published: list = []  # the KV events publish_kv_events sent (ATOM: over its ZMQ PUB socket)
        from atom.utils.forward_context import get_kvconnector

        self._upstream = bool(getattr(config, "upstream_connector_contract", False))
        if self._upstream:
            self.kv_connector = get_kvconnector("scheduler", config, block_manager=self.block_manager)
        else:
            self.kv_connector = get_kvconnector("scheduler", config)

    # -- queues --------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def extend(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self._rejected and not self.deferred_free_blocks

    def take_rejected(self) -> list[Sequence]:
        out, self._rejected = self._rejected, []
        return out

    def _flag(self, name: str) -> bool:
        return bool(getattr(self.kv_connector, name, False))

    def _should_defer_free(self, seq: Sequence) -> bool:
        callback = getattr(self.kv_connector, "should_defer_free", None)
        return bool(callable(callback) and callback(seq))

    @staticmethod
    def _pop_id(ids: list, sid: int) -> bool:
        for candidate in (sid, str(sid)):
            if candidate in ids:
                ids.remove(candidate)
                return True
        return False

    # -- schedule ------------------------------------------------------------
    def schedule(self) -> Optional[tuple[ScheduledBatch, dict[int, Sequence]]]:
        if not self.running and not self.waiting:
            return None
        scheduled: dict[int, Sequence] = {}
        tokens: list[int] = []
        cached: list[int] = []
        skipped: deque[Sequence] = deque()
        used = 0
        while self.waiting and len(scheduled) < self.max_num_seqs and used < self.max_num_batched_tokens:
            seq = self.waiting.popleft()
            if seq.status == SequenceStatus.ABORTED:
                seq.status = SequenceStatus.FINISHED
                seq.leave_reason = "aborted"
                self._rejected.append(seq)
                if self._upstream and self.kv_connector is not None:
                    self.kv_connector.request_finished(seq)
                self._num_parked_remote_kv -= int(getattr(seq, "_parked", False))
                seq._parked = False
                continue
            ready = False
            if seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
                if self._pop_id(self.failed_recving_kv_req_ids, seq.id):
                    seq.status = SequenceStatus.WAITING
                    self._num_parked_remote_kv -= 1
                    seq._parked = False
                elif self._pop_id(self.finished_recving_kv_req_ids, seq.id):
                    ready = True
                    self._num_parked_remote_kv -= 1
                    seq._parked = False
                else:
                    skipped.append(seq)
                    continue
            if ready:
                self._record_remote_store(seq)
                self._first_decode_after_remote_kv(seq)
                continue
            needs = False
            if self.kv_connector is not None:
                needs = self.kv_connector.get_num_new_matched_tokens(seq)[1]
            if needs and len(self.running) + self._num_parked_remote_kv >= self.max_num_seqs:
                self.waiting.appendleft(seq)
                break
            if self.block_manager.can_allocate(seq) < 0 or (scheduled and used + seq.num_tokens >
                                                            self.max_num_batched_tokens):
                self.waiting.appendleft(seq)
                break
            self.block_manager.allocate(seq)
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(seq)
            if needs and hasattr(self.kv_connector, "should_park_for_load_after_alloc"):
                needs = self.kv_connector.should_park_for_load_after_alloc(seq)
            if needs:
                skipped.append(seq)
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                seq._parked = True
                self._num_parked_remote_kv += 1
                continue
            seq.status = SequenceStatus.RUNNING
            seq.type = SequenceType.PREFILL
            self.running.append(seq)
            scheduled[seq.id] = seq
            tokens.append(seq.num_tokens - seq.num_cached_tokens)
            cached.append(seq.num_cached_tokens)
            used += tokens[-1]
        self.waiting.extend(skipped)
        if scheduled:
            meta = self.kv_connector.build_connector_meta() if self.kv_connector is not None else None
            return ScheduledBatch(scheduled, tokens, meta, len(scheduled), cached), scheduled
        for seq in list(self.running):
            if len(scheduled) >= self.max_num_seqs or not self.block_manager.can_append(seq, 1):
                break
            injected = seq.is_first_decode and (seq.kv_transfer_params or {}).get("first_token_id") is not None
            if not seq.is_first_decode or injected:
                self.block_manager.may_append(seq, 1)
            seq.type = SequenceType.DECODE
            seq.is_first_decode = False
            scheduled[seq.id] = seq
            tokens.append(1)
            cached.append(seq.num_cached_tokens)
        meta = self.kv_connector.build_connector_meta() if self.kv_connector is not None else None
        return ScheduledBatch(scheduled, tokens, meta, 0, cached), scheduled

    def _record_remote_store(self, seq: Sequence) -> None:
        """ATOM's ``_update_waiting_for_remote_kv`` with KV events on: the loaded full prompt blocks past the
        local hit, as one BlockStored(REMOTE)."""
        bm = self.block_manager
        if not bm.kv_events_enabled:
            return
        bs = bm.block_size
        cached = seq.num_cached_tokens // bs
        hashes, tokens, parent, h = [], [], None, None
        for i in range(min(seq.num_prompt_tokens // bs, len(seq.block_table))):
            block = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash((h, tuple(block))) & (2**64 - 1)  # FAKE hash: ATOM's is xxh64(parent || tokens)
            if i < cached:
                parent = h
                continue
            hashes.append(h)
            tokens.extend(block)
        bm.record_remote_store(block_hashes=hashes, token_ids=tokens, parent_block_hash=parent)

    def publish_kv_events(self) -> None:
        self.published.extend(self.block_manager.take_events())

    def shutdown_kv_events(self) -> None:
        return

    def _first_decode_after_remote_kv(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.is_first_decode = True
        first = (seq.kv_transfer_params or {}).get("first_token_id")
        if first is not None:
            seq.append_token(first)
        seq.num_cached_tokens = seq.num_prompt_tokens
        self.running.append(seq)

    # -- after the forward ---------------------------------------------------
    def postprocess(self, seqs: list[Sequence], fwd_output: ScheduledBatchOutput, stream_output_queue: Any = None,
                    batch: Any = None) -> list[Sequence]:
        finished: list[Sequence] = []
        for seq in seqs:
            idx = fwd_output.req_ids.index(seq.id) if seq.id in fwd_output.req_ids else None
            if idx is None:
                continue
            if seq.type == SequenceType.PREFILL:
                seq.num_cached_tokens = seq.num_prompt_tokens
            for token in fwd_output.token_ids[idx]:
                seq.append_token(token)
            leave = None
            if seq.status == SequenceStatus.ABORTED:
                leave = "aborted"
            elif not seq.ignore_eos and self.eos_token_id in fwd_output.token_ids[idx]:
                leave = "eos"
            elif seq.num_tokens - seq.num_prompt_tokens >= seq.max_tokens:
                leave = "max_tokens"
            if stream_output_queue is not None and leave is not None and self.kv_connector is not None:
                self.kv_connector.request_finished(seq)
            if leave is not None:
                seq.leave_reason = leave
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
        for seq in finished:
            if self.kv_connector is not None:
                if hasattr(self.kv_connector, "request_finished"):
                    self.kv_connector.request_finished(seq)
                if self._flag("is_producer") or self._should_defer_free(seq):
                    self.deferred_free_blocks[seq.id] = seq
                else:
                    self.block_manager.deallocate(seq)
            else:
                self.block_manager.deallocate(seq)
            self.running.remove(seq)
        return finished

    def _update_from_kv_xfer_finished(self, output: Any) -> None:
        if output is None:
            return
        process_completions = getattr(self.kv_connector, "process_completions", None)
        if callable(process_completions):
            output = process_completions(output)
        for req_id in output.finished_recving or ():
            assert not self._flag("is_producer")
            self.finished_recving_kv_req_ids.append(req_id)
        for req_id in output.failed_recving or ():
            assert not self._flag("is_producer")
            self.failed_recving_kv_req_ids.append(req_id)
        for req_id in output.finished_sending or ():
            assert self.kv_connector.is_producer
            seq = self.deferred_free_blocks.pop(req_id, None)
            assert seq is not None, f"req_id={req_id} not found in deferred_free_blocks"
            self.block_manager.deallocate(seq)
        for req_id in output.finished_saving or ():
            seq = self.deferred_free_blocks.get(req_id)
            if seq is not None and not self._flag("is_producer") and not self._should_defer_free(seq):
                if hasattr(self.kv_connector, "request_finished"):
                    self.kv_connector.request_finished(seq)
                del self.deferred_free_blocks[req_id]
                self.block_manager.deallocate(seq)
