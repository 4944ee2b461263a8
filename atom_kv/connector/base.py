"""The hooks an engine calls: one method per hook, one docstring each.

Engines reach these through :mod:`atom_kv.engine_hooks`; the connector
implements them here. Shaped after vLLM's ``KVConnectorBase_V1``, split in two objects:

- :class:`SchedulerHooks` lives in the engine's scheduler (one per engine).
- :class:`WorkerHooks` lives in each TP rank's model runner.

Between them the engine moves a :class:`ConnectorMetadata` (scheduler ->
every worker, once per step) and :class:`KVConnectorOutput` (every worker ->
an aggregator -> scheduler, once per step).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from atom_kv.connector.routes_view import RouteReport
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, SchedulerEvents

__all__ = ["SchedulerHooks", "WorkerHooks", "KVCacheLayer"]

#: One layer's cache in the layout ``CompatInfo.layout`` names (``atom_kv.connector.cache_layouts``):
#: a ``(k, v)`` pair (HND: ``[num_blocks, kv_heads, block_size, head_dim]``, this rank's heads), one MLA
#: latent tensor ``[num_blocks, block_size, latent_dim]``, vLLM's one K-and-V tensor per layer
#: (``vllm-hnd``, ``vllm-cpu``), or a mapping of kind to tensor for layouts with more tensors per
#: layer (``{"k", "v", "k_scale", "v_scale"}``, ``{"latent", "index"}``).
KVCacheLayer = Union[tuple[Any, Any], Mapping[str, Any], Any]


class SchedulerHooks(abc.ABC):
    """Scheduler-side connector: owns per-request transfer state, leases and
    timeouts. Called only from the engine's scheduler thread."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Optional[dict],
        num_computed_tokens: int = 0,
    ) -> tuple[int, bool]:
        """How many prompt tokens will arrive from a remote engine, and whether
        they load asynchronously (the request then waits for remote KV).

        ``num_computed_tokens`` are prompt tokens already in local blocks (a
        local prefix-cache hit: a multiple of the block size, except possibly
        for a hit on the whole prompt). A consumer then reads only the remote
        blocks from index ``num_computed_tokens // block_size`` on, into the
        matching local blocks, and returns ``num_prompt_tokens -
        num_computed_tokens``; when nothing is left to read it returns
        ``(0, False)``, loads nothing and lets the producer free its blocks.

        A producer returns ``(0, False)``; a request with ``do_remote_decode``
        gets a transfer id: the request's own ``transfer_id`` when it carries a
        usable one (1..128 printable ASCII characters, not in use by another
        live or recent transfer of this engine), else one minted here.
        ``request_finished`` returns the id actually used.

        Contract: idempotent, but not side-effect free as vLLM's
        ``KVConnectorBase_V1`` calls this hook. It admits a producer's send and
        may send a consumer's release for refused params; calling it again for
        the same request changes nothing more than calling it once, so an
        engine may ask on every scheduling attempt. Scheduler thread only.
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request; remember where its remote KV goes.

        ``block_ids`` are ALL the request's prompt blocks, locally cached ones
        included (the connector skips those itself).
        """

    @abc.abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """Per-step metadata for every worker; resets the step's pending work
        (not idempotent: call exactly once per engine step)."""

    @abc.abstractmethod
    def update_connector_output(self, output: KVConnectorOutput, now: Optional[float] = None) -> SchedulerEvents:
        """Ingest the finished sets aggregated over all ranks (empty is fine),
        expire leases and load timeouts, and say what the engine must do.
        Call once per engine step, and at least every second when idle; while
        ``has_pending()`` a producer should step within a fraction of a second
        (a release arrives on a worker and only takes effect in a step)."""

    @abc.abstractmethod
    def request_finished(
        self, request_id: str, block_ids: Sequence[int], *, aborted: bool = False,
        first_token_ids: Sequence[int] = (),
    ) -> tuple[bool, Optional[dict]]:
        """The request finished (or was aborted). Returns ``(delay_free, kv_transfer_params)``:
        when ``delay_free`` the engine keeps the blocks until a later
        ``SchedulerEvents.free`` names the request; the params go in the
        response (a producer's carry the ``transfer_id`` it used).

        A producer may pass the token it sampled (``first_token_ids``): the
        params then carry it, and so does the rendezvous answer to a decode
        engine that asks for the blocks while its leg is already waiting.

        Call it for every request the scheduler saw, whatever its state (waiting
        for blocks, waiting for remote KV, running): on a consumer, a request
        that ends before its remote KV was read releases the producer's blocks
        at once (a release message to every producer rank)."""

    def request_rejected(self, kv_transfer_params: Optional[dict]) -> None:
        """The engine dropped a request the connector never saw: refused up front
        (bad ``max_tokens``, a prompt longer than the model, a bad parameter),
        aborted while it waited for admission, or failed with the engine.

        Pass the request's ``kv_transfer_params`` as the client sent them (any
        value; ``None`` is fine). On a consumer, when they name a remote prefill
        (``do_remote_prefill``, ``transfer_id``, ``remote_host``, a handshake
        port), every producer rank is told to release its blocks now instead of
        holding them for ``abort_timeout_s``. Non-blocking, safe to call for
        any rejection; from the scheduler's thread like every hook."""

    def has_pending(self) -> bool:
        """True while any transfer or lease is outstanding (the engine keeps ticking)."""
        return False

    def has_metadata(self) -> bool:
        """True when the next ``build_connector_meta`` carries news for the workers (a lent
        transfer, a freed one, a load to start or cancel). An idle engine that steps at
        once instead of on its next tick lets its ranks answer the decode engines sooner."""
        return False

    def close(self) -> None:
        """Release what the scheduler side holds."""


class WorkerHooks(abc.ABC):
    """Model-runner-side connector for one TP rank: owns the rank's transfer
    backend, handshake server and client, and in-flight reads."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[KVCacheLayer]) -> None:
        """Register this rank's KV cache tensors, one entry per layer, block-major."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Start this step's reads and bookkeeping; never blocks on the network.

        Engines must call it on every rank before each step's forward: the
        producer learns here (``metadata.released``) which transfers' blocks
        the scheduler freed, before a forward can overwrite them, and only
        confirms consumer reads of transfers it has not released.
        """

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that finished on this rank since the last call."""

    @abc.abstractmethod
    def set_engine_id(self, engine_id: str) -> None:
        """Take the engine's id after construction, for engines whose rank
        processes start before the one that names the engine (ATOM). Call
        before the first step's ``start_load_kv``."""

    def stats(self) -> dict[str, float]:
        """Cumulative transfer statistics for metrics (bytes, seconds, ranges, retries, failures)."""
        return {}

    def routes(self) -> RouteReport:
        """The backend each producer peer is read with (on a decode rank), and
        the backend's fallbacks by reason, for metrics and health."""
        return RouteReport()

    def set_waker(self, wake: Optional[Callable[[], None]]) -> None:
        """Call ``wake()`` (from a connector thread; it must not block) whenever
        :meth:`get_finished` has news, so an idle engine can step at once
        instead of polling. Optional: engines that step anyway need not set it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads, close sockets, release the backend. Idempotent."""
