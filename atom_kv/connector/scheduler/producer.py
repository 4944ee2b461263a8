"""The prefill engine's scheduler side: a transfer id per request that asks for a remote
decode, a lease on its blocks once it finishes, and the lease's end (every consumer rank
read them, a release, or ``abort_timeout_s``), each freeing the blocks exactly once.

One :class:`_Send` record per transfer, in one table found by request id or by transfer id::

    get_num_new_matched_tokens(do_remote_decode) -> ADMITTED (the request's own transfer_id
        when usable, else one minted; metadata.coming)
    request_finished with blocks -> LEASED (deadline = now + abort_timeout_s; metadata.sends)
    request_finished aborted or without blocks -> forgotten (metadata.dropped)
    finished_sending(tid) | deadline -> SchedulerEvents.free (once), metadata.released
        (the workers record released ids and tell a consumer that reads one
        afterwards that its read is invalid: its load fails)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Sequence

from atom_kv._lru import BoundedDict, BoundedSet
from atom_kv.config import KVTransferConfig
from atom_kv.connector.params import ParamsIn, RequestParams
from atom_kv.connector.release import ReleaseSpec
from atom_kv.connector.scheduler.common import MAX_RECENT_TRANSFERS, Deadlines, RoleScheduler, TimerKind
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, SchedulerEvents, SendSpec
from atom_kv.wire import MAX_TRANSFER_ID_CHARS, KVTransferParams

__all__ = ["MAX_EARLY_DONE", "ProducerScheduler", "SendState"]

logger = logging.getLogger(__name__)

#: finished-sending reports remembered until their lease exists
MAX_EARLY_DONE = 4096


class SendState(Enum):
    """Where a transfer of a prefill engine stands."""

    #: a transfer id is assigned; the request computes (a rank answers a rendezvous question "still coming")
    ADMITTED = "admitted"
    #: the request finished and its blocks are lent until every consumer rank read them, a release, or the deadline
    LEASED = "leased"


@dataclass(eq=False)
class _Send:
    request_id: str
    transfer_id: str
    state: SendState = SendState.ADMITTED
    block_ids: list[int] = field(default_factory=list)
    deadline: float = 0.0


class _Sends:
    """Owns the producer's transfers: one :class:`_Send` each, found by request id or by
    transfer id (two indexes onto the same records, changed only here)."""

    def __init__(self) -> None:
        self._by_request: dict[str, _Send] = {}
        self._by_transfer: dict[str, _Send] = {}
        self._leased = 0

    def admit(self, request_id: str, transfer_id: str) -> _Send:
        send = self._by_request[request_id] = self._by_transfer[transfer_id] = _Send(request_id, transfer_id)
        return send

    def of_request(self, request_id: str) -> Optional[_Send]:
        return self._by_request.get(request_id)

    def of_transfer(self, transfer_id: str) -> Optional[_Send]:
        return self._by_transfer.get(transfer_id)

    def lease(self, send: _Send, block_ids: list[int], deadline: float) -> None:
        send.state, send.block_ids, send.deadline = SendState.LEASED, block_ids, deadline
        self._leased += 1

    def remove(self, send: _Send) -> None:
        del self._by_request[send.request_id]
        del self._by_transfer[send.transfer_id]
        if send.state is SendState.LEASED:
            self._leased -= 1

    @property
    def num_leased(self) -> int:
        return self._leased

    def clear(self) -> None:
        self._by_request.clear()
        self._by_transfer.clear()
        self._leased = 0


@dataclass
class _Step:
    """What the next :meth:`ProducerScheduler.build_connector_meta` tells the ranks."""

    sends: list[SendSpec] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    coming: list[str] = field(default_factory=list)   # admitted: the ranks answer "still coming" for them
    dropped: list[str] = field(default_factory=list)  # admitted, then ended without lending blocks

    def __bool__(self) -> bool:
        return bool(self.sends or self.released or self.coming or self.dropped)


class ProducerScheduler(RoleScheduler):
    """The scheduler side of a prefill engine (``kv_producer``): owns its transfers (one
    record each), their leases and lease deadlines, and the finished-sending reports that
    came before their lease.

    ``announce_sends``: also tell the engine's own ranks at once which blocks each transfer
    lent (an :class:`~atom_kv.wire.Issued` notice), for engines that pass the step's metadata
    to their ranks only with their next batch (ATOM): a rank confirms reads only of
    transfers it knows."""

    notice_role = "prefill"
    kv_role = "kv_producer"

    def __init__(self, config: KVTransferConfig, *, engine_id: str, host: str, tp_size: int, dp_rank: int = 0,
                 dp_size: int = 1, pp_size: int = 1, block_size: int,
                 release_sender: Optional[Callable[[ReleaseSpec, str], None]] = None,
                 announce_sends: bool = False) -> None:
        super().__init__(config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size,
                         pp_size=pp_size, block_size=block_size, release_sender=release_sender)
        self._announce_sends = announce_sends
        self._sends = _Sends()
        self._early_done: BoundedDict[str, float] = BoundedDict(MAX_EARLY_DONE)  # tid -> when reported
        self._recent_tids: BoundedSet[str] = BoundedSet(MAX_RECENT_TRANSFERS)
        self._step = _Step()
        self._timers = Deadlines(TimerKind.LEASE)

    # ------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int, kv_transfer_params: ParamsIn,
                                   num_computed_tokens: int = 0) -> tuple[int, bool]:
        """Always ``(0, False)``: a prefill engine loads nothing. Side effect (unlike vLLM's
        contract for this hook, which calls it side-effect free): a request whose params ask
        for a remote decode is admitted here, its transfer id assigned and announced to the
        ranks in the next metadata (``coming``); refused params are logged.

        Idempotent: the engine may call it any number of times for a request (again while
        it waits for admission, or after a preemption); only the first call with params
        admits, later ones change nothing. Called by the engine's scheduler, on
        its thread, for each request it considers scheduling."""
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        if kv_transfer_params and self._sends.of_request(request_id) is None:
            self._register_send(request_id, RequestParams.of(kv_transfer_params))
        return 0, False

    def _register_send(self, request_id: str, params: RequestParams) -> None:
        if params.send_refusal is not None:
            logger.warning("request %s: ignoring kv_transfer_params (%s); its KV will not be kept for a remote "
                           "decode", request_id, params.send_refusal)
            return
        if not params.wire.do_remote_decode:
            return
        tid = self._transfer_id(request_id, params)
        self._sends.admit(request_id, tid)
        self._step.coming.append(tid)

    def _transfer_id(self, request_id: str, params: RequestParams) -> str:
        """The request's own transfer id when it is usable here, else one minted from ours."""
        offered = params.offered_transfer_id
        if offered is not None:
            tid = params.adoptable_transfer_id
            if tid is not None and not self._transfer_id_taken(tid):
                return tid
            why = ("in use by another transfer" if tid is not None
                   else f"not 1..{MAX_TRANSFER_ID_CHARS} printable ASCII characters")
            logger.warning("request %s: not adopting transfer_id %.160r (%s); minting one", request_id, offered, why)
        return f"{self.engine_id}-{request_id}"

    def _transfer_id_taken(self, tid: str) -> bool:
        return self._sends.of_transfer(tid) is not None or tid in self._recent_tids

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Nothing to do on a prefill engine (no side effect; any number of calls)."""

    # ------------------------------------------------------------------
    # per step
    # ------------------------------------------------------------------
    def build_connector_meta(self) -> ConnectorMetadata:
        """This step's news for every rank: transfers admitted (``coming``), lent (``sends``),
        ended without lending (``dropped``) and freed (``released``). Not idempotent: it hands
        the news over and resets it, so call it exactly once per engine step, on the scheduler
        thread, and give its result to every rank's ``start_load_kv``."""
        step, self._step = self._step, _Step()
        return ConnectorMetadata(loads=[], sends=step.sends, released=step.released, cancelled=[],
                                 coming=step.coming, dropped=step.dropped)

    def has_metadata(self) -> bool:
        """Whether the next metadata carries news. No side effect; any number of calls."""
        return bool(self._step)

    def update_connector_output(self, output: KVConnectorOutput, now: Optional[float] = None) -> SchedulerEvents:
        """Frees each lease whose transfer every consumer rank finished (``finished_sending``,
        aggregated over this engine's ranks) and each lease past its deadline: every freed
        request is named in ``SchedulerEvents.free`` exactly once, and its transfer id in the
        next metadata's ``released``. A report for a transfer not yet leased is remembered
        (a bounded few, for one lease time) and frees the lease as soon as it exists.
        Idempotent per report: a transfer reported again frees nothing. Call once per
        engine step (empty output is fine), and within a fraction of a second while
        :meth:`has_pending`, on the scheduler thread."""
        now = time.monotonic() if now is None else now
        events = SchedulerEvents()
        for tid in output.finished_sending:
            send = self._sends.of_transfer(tid)
            if send is not None and send.state is SendState.LEASED:
                self._free_lease(send, events, "all consumer ranks finished reading")
            else:
                # reported before request_finished created the lease (or late): remember a bounded few
                self._early_done[tid] = now
        self._expire(now, events)
        return events

    def _expire(self, now: float, events: SchedulerEvents) -> None:
        early = []
        for tid, at in self._early_done.items():  # oldest first
            if now - at <= self.config.abort_timeout_s:
                break
            early.append(tid)
        for tid in early:  # a report whose lease never came: forgotten after one lease time
            del self._early_done[tid]
        for timer in self._timers.due(now):
            send = self._sends.of_transfer(timer.key)
            if send is None or send.state is not SendState.LEASED or send.deadline != timer.deadline:
                continue
            logger.warning(
                "request %s: lease on %d blocks of transfer %s expired after %.1f s without all "
                "consumers reading; freeing them",
                send.request_id, len(send.block_ids), send.transfer_id, self.config.abort_timeout_s,
            )
            self._free_lease(send, events, None)

    def _free_lease(self, send: _Send, events: SchedulerEvents, why: Optional[str]) -> None:
        self._sends.remove(send)
        self._recent_tids.add(send.transfer_id)
        events.free.append(send.request_id)
        self._step.released.append(send.transfer_id)
        if why:
            logger.debug("request %s: freeing %d blocks of transfer %s (%s)", send.request_id, len(send.block_ids),
                         send.transfer_id, why)

    # ------------------------------------------------------------------
    # end of a request
    # ------------------------------------------------------------------
    def request_finished(self, request_id: str, block_ids: Sequence[int], *, aborted: bool = False,
                         first_token_ids: Sequence[int] = ()) -> tuple[bool, Optional[dict]]:
        """Leases the finished request's blocks to its transfer: ``(True, params)`` with the
        params a decode engine reads them by; the engine keeps the blocks until a later
        ``SchedulerEvents.free`` names the request. A request without a transfer, or aborted,
        gets ``(False, None)``; one without blocks ``(False, params)``. Side effects: the
        lease and its deadline, the transfer in the next metadata (``sends``, or ``dropped``),
        and with ``announce_sends`` an issue notice to this engine's ranks. Idempotent: a
        request already leased answers ``(True, None)`` and changes nothing. Called by the
        engine's scheduler once a request ends, on its thread."""
        send = self._sends.of_request(request_id)
        if send is None:
            return False, None
        if send.state is SendState.LEASED:
            return True, None  # already leased; the consumer may be reading
        tid = send.transfer_id
        if aborted or not block_ids:
            self._sends.remove(send)
            self._step.dropped.append(tid)  # a rank holding a rendezvous question on it answers at once
        if aborted:
            return False, None
        blocks = [int(b) for b in block_ids]
        params = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=blocks,
            remote_engine_id=self.engine_id,
            remote_host=self.host,
            remote_port=self.config.handshake_port,
            remote_handshake_port=self.config.handshake_port,
            remote_tp_size=self.tp_size,
            remote_dp_rank=self.dp_rank,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
            remote_dp_size=self.dp_size if self.dp_size > 1 else None,
            remote_pp_size=self.pp_size if self.pp_size > 1 else None,
            transfer_id=tid,
        ).to_dict()
        first = [int(t) for t in first_token_ids]
        if first:
            params["first_token_ids"] = first
        if not blocks:
            return False, params
        deadline = time.monotonic() + self.config.abort_timeout_s
        self._sends.lease(send, blocks, deadline)
        self._step.sends.append(SendSpec(transfer_id=tid, block_ids=blocks, first_token_ids=first))
        if self._announce_sends:  # the ranks may see this step's metadata only with the next batch
            own = ReleaseSpec.bounded(tid, self.host, self.config.handshake_port, self.tp_size, self.dp_rank,
                                      self.pp_size, self.dp_size)
            if own is not None:  # None: an OS-assigned handshake port (tests), where no notice can go
                self._notices().issue(own, blocks)
        self._timers.add(deadline, tid)
        if self._early_done.pop(tid, None) is not None:
            send.deadline = 0.0  # already read or released: free on the next update
            self._timers.add(0.0, tid)
        logger.debug("request %s: holding %d blocks for transfer %s", request_id, len(blocks), tid)
        return True, params

    # ------------------------------------------------------------------
    def has_pending(self) -> bool:
        """True while a lease is held or the ranks have yet to hear of a lent or freed
        transfer. No side effect; any number of calls."""
        return bool(self._sends.num_leased or self._step.sends or self._step.released)

    def num_leases(self) -> int:
        return self._sends.num_leased

    def close(self) -> None:
        """Forgets every transfer and stops the notice sender. Idempotent; called once by the
        engine's shutdown, after its last step."""
        if self._sends.num_leased:
            logger.info("scheduler hooks closing with %d leases outstanding", self._sends.num_leased)
        self._sends.clear()
        self._timers.clear()
        self._close_sender()
