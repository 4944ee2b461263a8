"""ATOM's worker-side connector (one per TP rank, in ATOM's model-runner process).

Under pipeline parallelism (a prefill engine only) every stage's model
runners build one: each rank registers its stage's layers, listens on its
stage's ports and names those layers in its handshake.

ATOM's ``get_kvconnector("worker")`` builds it with the engine ``Config``;
its model runner then calls :meth:`~AtomKVWorker.register_kv_caches` once with
the KV cache dict, :meth:`~AtomKVWorker.start_load_kv` with every step's
metadata before the forward, and :meth:`~AtomKVWorker.get_finished` when the
engine core polls. Underneath runs this rank's atom-kv
:class:`~atom_kv.engine_hooks.WorkerHooks`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping, Optional

from atom.kv_transfer.disaggregation.base import KVConnectorBase
from atom.kv_transfer.disaggregation.types import KVConnectorOutput as AtomKVConnectorOutput

from atom_kv import engine_hooks
from atom_kv.connector.cache_layouts import LayoutMismatch
from atom_kv.engine_hooks import WorkerHooks
from atom_kv.integrations.atom.caches import AtomCaches, describe_atom_caches
from atom_kv.integrations.atom.settings import AtomEngine, advertised_host, require_completion_contract

__all__ = ["AtomKVWorker"]

logger = logging.getLogger(__name__)


class AtomKVWorker(KVConnectorBase):
    """Owns one TP rank's atom-kv worker hooks and the ATOM caches registered with them.

    ``tp_rank``/``tp_size``/``dp_rank`` default to AITER's process groups, as
    ATOM's own connectors read them; tests and other embedders pass them.
    """

    def __init__(self, config: Any, *, tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                 dp_rank: Optional[int] = None, host: Optional[str] = None) -> None:
        require_completion_contract(AtomKVConnectorOutput)
        engine = AtomEngine.from_config(config)
        if tp_rank is None or tp_size is None or dp_rank is None:
            groups = _aiter_ranks()
            tp_rank = groups[0] if tp_rank is None else tp_rank
            tp_size = groups[1] if tp_size is None else tp_size
            dp_rank = groups[2] if dp_rank is None else dp_rank
        self.is_producer = engine.kv.is_producer
        self.tp_rank, self.tp_size, self.dp_rank = tp_rank, tp_size, dp_rank
        self.host = host or engine.kv.advertise_host or advertised_host()
        self._engine = engine
        self._caches: Optional[AtomCaches] = None
        self._hooks: Optional[WorkerHooks] = None
        self._engine_id: Optional[str] = None

    def register_kv_caches(self, kv_caches: Mapping[str, Any], transfer_tensors: Any = None,
                           num_blocks: Optional[int] = None) -> None:
        """Check ATOM's caches, register them with the transfer backend and (a
        producer) start answering handshakes. Refuses, in one line, a layout or
        a model atom-kv cannot move. Called again (ATOM reallocated its cache),
        it starts over with the new tensors."""
        engine = self._engine
        staged = engine.pp_size > 1
        if staged and engine.num_layers is None:
            raise LayoutMismatch(f"pipeline stage {engine.pp_rank} of {engine.pp_size}: ATOM's config has no "
                                 "hf_config.num_hidden_layers, so the model's layers are unknown")
        caches = describe_atom_caches(kv_caches, block_size=engine.block_size, tp_size=self.tp_size,
                                      model_id=engine.model, num_blocks=num_blocks,
                                      transfer_tensors=transfer_tensors,
                                      model_layers=engine.num_layers if staged else None)
        if self._hooks is not None:
            self._hooks.close()  # its ports and registrations are the new hooks' to take
            self._hooks, self._engine_id = None, None
        # The scheduler-side connector names the engine; every step's metadata
        # carries that name. Until the first step this rank answers handshakes
        # as an engine nobody can have KV from (a restarted producer is found out).
        hooks = engine_hooks.build_worker_hooks(
            engine.kv, engine_id=f"starting-{uuid.uuid4().hex[:12]}", host=self.host, tp_rank=self.tp_rank,
            tp_size=self.tp_size, dp_rank=self.dp_rank, dp_size=max(engine.dp_size, self.dp_rank + 1),
            pp_rank=engine.pp_rank, pp_size=engine.pp_size, start_layer=caches.first_layer, compat=caches.compat,
        )
        try:
            hooks.register_kv_caches(caches.layers)
        except BaseException:
            hooks.close()
            raise
        self._caches, self._hooks = caches, hooks
        stage = f", pipeline stage {engine.pp_rank}/{engine.pp_size} from layer {caches.first_layer}" if staged else ""
        logger.info("atom_kv rank %d/%d: %s KV cache, %d layers%s, %s", self.tp_rank, self.tp_size,
                    caches.layout.label, len(caches.layers), stage, caches.compat)

    def start_load_kv(self, metadata: Any) -> None:
        """Start this step's reads, note released and cancelled transfers; never blocks on the network."""
        step = getattr(metadata, "step", None)
        if step is None:
            return  # not ours (ATOM builds metadata only through the scheduler-side connector)
        if self._hooks is None:
            raise RuntimeError("atom_kv: start_load_kv before register_kv_caches")
        if metadata.engine_id != self._engine_id:
            self._hooks.set_engine_id(metadata.engine_id)
            self._engine_id = metadata.engine_id
        self._hooks.start_load_kv(step)

    def get_finished(self) -> AtomKVConnectorOutput:
        """This rank's finished transfers since the last call: producer transfer
        ids read by every consumer rank, consumer requests loaded or failed (by
        the scheduler-side request id; this rank's log names each failure's cause)."""
        out = AtomKVConnectorOutput()
        if self._hooks is None:
            return out
        done = self._hooks.get_finished()
        out.finished_sending = set(done.finished_sending)
        out.finished_recving = set(done.finished_recving)
        out.failed_recving = set(done.failed_recving)
        return out

    def stats(self) -> dict[str, float]:
        """Cumulative transfer statistics of this rank."""
        return self._hooks.stats() if self._hooks is not None else {}

    def close(self) -> None:
        """Stop this rank's threads and sockets and release the backend (idempotent)."""
        if self._hooks is not None:
            self._hooks.close()


def _aiter_ranks() -> tuple[int, int, int]:
    """(tp_rank, tp_size, dp_rank) from AITER's process groups, as ATOM's connectors read them."""
    from aiter.dist.parallel_state import get_dp_group, get_tp_group

    tp = get_tp_group()
    try:
        dp_rank = get_dp_group().rank_in_group
    except Exception:  # no DP group: a single data-parallel rank
        dp_rank = 0
    return tp.rank_in_group, tp.world_size, dp_rank
