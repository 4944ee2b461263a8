"""Values that cross the engine/connector seam (and TP process boundaries).

All are msgspec Structs: cheap to encode once per step and send to every
TP worker, and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

__all__ = ["LoadSpec", "SendSpec", "ConnectorMetadata", "KVConnectorOutput", "SchedulerEvents"]


class LoadSpec(msgspec.Struct, kw_only=True, array_like=True):
    """Consumer: read ``remote_block_ids`` of the producer into ``block_ids``."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    num_tokens: int
    remote_engine_id: str
    remote_host: str
    remote_handshake_port: int
    remote_tp_size: int = 1
    remote_dp_rank: int = 0
    #: where ``remote_block_ids`` start in the transfer's block list (blocks
    #: before it were cached locally and are not read)
    remote_block_offset: int = 0
    #: the producer's pipeline stages (each holds some layers) and DP size (places later stages' ports)
    remote_pp_size: int = 1
    remote_dp_size: int = 1
    #: the rendezvous: ``remote_block_ids`` are not known yet (the decode leg
    #: was sent while the prefill computed); each rank asks the producer for them
    await_blocks: bool = False


class SendSpec(msgspec.Struct, kw_only=True, array_like=True):
    """Producer: ``block_ids`` of ``transfer_id`` are held for remote readers."""

    transfer_id: str
    block_ids: list[int]
    #: the token the prefill sampled for the request (its rank answers it with the blocks)
    first_token_ids: list[int] = []


class ConnectorMetadata(msgspec.Struct, kw_only=True):
    """What the scheduler-side connector tells every worker for one step."""

    loads: list[LoadSpec] = []
    sends: list[SendSpec] = []
    released: list[str] = []   # producer transfer ids whose blocks were freed (done, released or lease expired)
    cancelled: list[str] = []  # consumer request ids aborted while loading
    #: producer transfer ids admitted this step (queued or computing: a rank answers a rendezvous
    #: question on one of them "still coming" rather than "unknown")
    coming: list[str] = []
    #: producer transfer ids admitted earlier whose request ended without lending blocks
    dropped: list[str] = []


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    """Finished sets from one worker (or, aggregated, from all of them)."""

    finished_sending: list[str] = []       # producer transfer ids
    finished_recving: list[str] = []       # consumer request ids
    failed_recving: dict[str, str] = {}    # consumer request id -> reason
    #: consumer request id -> the prefill's first token, learned with the blocks (the rendezvous)
    first_tokens: dict[str, list[int]] = {}
    #: consumer request ids (finished or failed, here or before) whose producer answered a handshake of
    #: this rank as the rank the params placed on its port: its other ranks may be released
    #: (:mod:`atom_kv.connector.known_producers`)
    reached: list[str] = []

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.first_tokens
                    or self.reached)


@dataclass
class SchedulerEvents:
    """What the engine's scheduler must act on after ``update_connector_output``.

    - ``ready``: remote KV fully loaded on every rank; schedule for decode.
    - ``failed``: request id -> error; end the request with that error and
      free its blocks.
    - ``recompute``: the load failed and policy is ``recompute``; keep the
      blocks and run the prefill locally.
    - ``free``: delayed frees now due; free these requests' blocks now.
    - ``first_tokens``: request id -> the prefill's first token, for a load
      whose decode leg asked to continue from it (``first_token_pending``)
      and that is still loading: the engine may append (and stream) it now;
      the request's first step then computes the next token. Comes before
      (or with) the request's ``ready``/``failed``/``recompute``.
    """

    ready: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    recompute: list[str] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    first_tokens: dict[str, list[int]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.ready or self.failed or self.recompute or self.free or self.first_tokens)
