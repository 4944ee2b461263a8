"""The engine core: scheduler + executor + connector hooks, driven by one loop thread.

The HTTP side calls :meth:`EngineCore.submit` / :meth:`EngineCore.abort` from
any thread; the loop thread owns every piece of scheduling state and reports
progress through the ``on_output`` callback. Connector hooks are reached only
through ``atom_kv.engine_hooks``.

An exception in one request's own processing (its admission, sampling, token
handling or end) fails that request only (a 500 to its client, see
:meth:`Scheduler.fail`). The engine stops only on what it cannot recover from:
a TP rank that died, failed or hung (:class:`WorkerFailure`), or an exception
in the step itself (the forward, the connector's per-step calls), after which
the ranks' and the connector's state is unknown. It says so in one line
(``engine ... stopping: ...``) and ends every request with a 503.

With ``--kv-events-config``, each step's changes to the prefix cache go to the
core's :class:`~atom_kv.reference.kv_events.publisher.KVEventPublisher` as one
batch, queued without waiting (events never stall a step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from atom_kv.config import KVTransferConfig
from atom_kv.logfmt import ENGINE
from atom_kv.reference.faults import FaultInjector, FaultStage
from atom_kv.reference.kv_events.config import KVEventsConfig
from atom_kv.reference.model_config import ModelConfig
from atom_kv.reference.request import Request, RequestError, RequestOutput
from atom_kv.reference.rank_io import RankSpec
from atom_kv.reference.sampling import Sampler
from atom_kv.reference.scheduler import Scheduler
from atom_kv.reference.tp import WorkerFailure, create_executor

if TYPE_CHECKING:
    from atom_kv.engine_hooks import RouteReport

__all__ = ["EngineArgs", "EngineCore"]

log = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """Engine settings (the CLI's flags)."""

    model_id: str = "atom-kv-tiny"
    seed: int = 0
    num_layers: int = 4
    tp: int = 1
    num_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 10240
    max_num_batched_tokens: int = 8192
    host: str = "127.0.0.1"  # the address peers are told (KV reads)
    bind_host: Optional[str] = None  # the KV listeners' address (None: host)
    threads: int = 1
    device: str = "cpu"  # the model's and the KV cache's: "cpu" or "cuda"
    idle_tick_s: float = 0.1      # slowest connector poll while transfers are outstanding
    fast_tick_s: float = 0.002    # first poll after a load starts or a transfer event arrives
    step_timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    drain_timeout_s: float = 2.0  # close(): a decode engine's wait for its ended loads to stop
    hurry_timeout_s: float = 1.0  # every close() wait once the shutdown is hurried (hurry())
    faults: FaultInjector = FaultInjector()  # test-only (--inject-request-fault): nothing by default
    enable_prefix_caching: bool = True  # --no-enable-prefix-caching turns it off
    kv_events: Optional[KVEventsConfig] = None  # --kv-events-config: None or not publishing, no events
    kv_checksum_dir: Optional[str] = None  # --kv-checksums: per-block checksums of lent and loaded KV

    def model_config(self) -> ModelConfig:
        return ModelConfig(seed=self.seed, num_layers=self.num_layers)


class EngineCore:
    """Owns the :class:`Scheduler`, the TP executor, the scheduler hooks and the loop thread."""

    def __init__(
        self,
        args: EngineArgs,
        kv_config: Optional[KVTransferConfig],
        on_output: Callable[[RequestOutput], None],
        on_fatal: Optional[Callable[[str], None]] = None,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        engine_id: Optional[str] = None,
    ) -> None:
        """``dp_rank``/``dp_size``: this core's data-parallel rank among the
        cores behind one address (its ranks listen on that rank's side-channel
        ports); ``engine_id`` overrides the configured or random name."""
        self.args = args
        self.kv_config = kv_config
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.engine_id = engine_id or (
            kv_config.engine_id if kv_config and kv_config.engine_id else None) or uuid.uuid4().hex[:16]
        self._on_output = on_output
        self.on_fatal = on_fatal
        self._commands: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._executor: Any = None
        self._publisher: Any = None  # the KV event publisher (start() binds it), when events are on
        self._hooks: Any = None
        self._aggregator: Any = None
        self._sampler = Sampler()
        self._faults = args.faults
        self._requests: dict[str, Request] = {}
        self._woken = False  # a rank's connector has news: step now (the loop thread's flag)
        self.hurried = False  # hurry() was called: every close() wait is cut to hurry_timeout_s
        self._settling = False  # close() waits for the connector to settle (the loop thread's flag)
        self._settled = threading.Event()
        self.fatal: Optional[str] = None
        self.worker_stats: list[dict[str, float]] = []
        #: each TP rank's latest peer routes (a rank sends them only when they change)
        self.worker_routes: dict[int, RouteReport] = {}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_ok": 0,
                         "requests_failed": 0, "requests_aborted": 0, "steps": 0}
        self.scheduler = Scheduler(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            vocab_size=args.model_config().vocab_size,
            faults=args.faults,
            enable_prefix_caching=args.enable_prefix_caching,
            record_events=self.publishes_events,
        )
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def role(self) -> str:
        if self.kv_config is None:
            return "colocated"
        return "producer" if self.kv_config.is_producer else "consumer"

    @property
    def publishes_events(self) -> bool:
        return self.args.kv_events is not None and self.args.kv_events.publishing

    @property
    def kv_events_endpoints(self) -> tuple[Optional[str], Optional[str]]:
        """Where subscribers connect for this core's events and their replay (None: not published)."""
        pub = self._publisher
        return (pub.endpoint, pub.replay_endpoint) if pub is not None else (None, None)

    def start(self) -> None:
        """Bind the KV event endpoints (when on), build the ranks (blocking: TP>1 waits for every
        rank to load), then start the loop thread."""
        a = self.args
        events = a.kv_events if self.publishes_events else None
        if events is not None:
            from atom_kv.reference.kv_events.publisher import KVEventPublisher

            self._publisher = KVEventPublisher(events, dp_rank=self.dp_rank, advertise_host=a.host).start()
        cfg_json = self.kv_config.to_json() if self.kv_config else None
        specs = [
            RankSpec(model=a.model_config(), model_id=a.model_id, num_blocks=a.num_blocks,
                     block_size=a.block_size, tp_rank=r, tp_size=a.tp, engine_id=self.engine_id,
                     host=a.host, kv_config_json=cfg_json, device=a.device, dp_rank=self.dp_rank,
                     dp_size=self.dp_size, bind_host=a.bind_host, kv_checksum_dir=a.kv_checksum_dir)
            for r in range(a.tp)
        ]
        self._executor = create_executor(specs, threads=a.threads, startup_timeout_s=a.startup_timeout_s,
                                         step_timeout_s=a.step_timeout_s)
        if self.kv_config is not None:
            from atom_kv import engine_hooks

            self._hooks = engine_hooks.build_scheduler_hooks(
                self.kv_config, engine_id=self.engine_id, host=a.host, tp_size=a.tp, dp_rank=self.dp_rank,
                dp_size=self.dp_size, block_size=a.block_size,
            )
            self._aggregator = engine_hooks.KVOutputAggregator(a.tp)
            self.scheduler.hooks = self._hooks
            self._executor.set_waker(self._wake)
        self._thread = threading.Thread(target=self._loop, name=f"atom-kv-engine-core-dp{self.dp_rank}", daemon=True)
        self._thread.start()
        log.info("engine %s (%s, dp rank %d/%d, tp=%d, device %s) started", self.engine_id, self.role, self.dp_rank,
                 self.dp_size, a.tp, a.device)

    def close(self) -> None:
        """Stop the loop (a decode engine once its ended loads stopped, within ``drain_timeout_s``),
        the hooks and the workers; after :meth:`hurry` every wait is ``hurry_timeout_s``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._hooks is not None and self._thread is not None and self._thread.is_alive():
            # the loop keeps running while the ranks stop the loads of ended requests (releases go out meanwhile)
            wait_s = self.args.hurry_timeout_s if self.hurried else self.args.drain_timeout_s
            self._commands.put(("settle", None))
            if not self._settled.wait(wait_s):
                log.warning("engine %s: KV loads still running after %g s; closing anyway", self.engine_id, wait_s)
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(self.args.hurry_timeout_s if self.hurried else 10.0)
        if self._hooks is not None:
            self._hooks.close()  # sends the releases still queued
        if self._executor is not None:
            self._executor.close(self.args.hurry_timeout_s if self.hurried else 5.0)
        if self._publisher is not None:
            self._publisher.close(self.args.hurry_timeout_s if self.hurried else 2.0)

    def hurry(self, end_requests: bool = True) -> None:
        """Hurry the shutdown: end every request now (the HTTP side answers 503 at once instead
        of waiting for them), releasing the producers' KV they name, and cut close()'s waits to
        ``hurry_timeout_s``. ``end_requests=False`` only cuts the waits (no lock is taken: safe
        in a signal handler). Any thread."""
        self.hurried = True
        if end_requests:
            self._commands.put(("hurry", None))

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, req: Request) -> None:
        """Queue ``req``; raises :class:`RequestError` if it can never run here."""
        if self.fatal:
            raise RequestError(f"engine is shutting down: {self.fatal}", status=503)
        vocab = self.args.model_config().vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise RequestError(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        self.scheduler.check(req)
        self._commands.put(("add", req))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def reject(self, kv_transfer_params: Any) -> None:
        """A request was refused before :meth:`submit` queued it (bad parameters, too
        long); a decode engine releases the producer's KV it names. Any thread."""
        if self._hooks is not None and isinstance(kv_transfer_params, dict):
            self._commands.put(("reject", kv_transfer_params))

    def snapshot(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "kv_total": s.blocks.num_blocks,
            "kv_free": s.blocks.num_free,
            "kv_cached": s.blocks.num_cached,
            "kv_held": sum(len(b) for b in list(s.held.values())),
            "running": len(s.running),
            "waiting": len(s.waiting),
            "waiting_remote": len(s.waiting_remote),
        }

    def _wake(self) -> None:
        """A rank's connector has news (any thread): the loop steps at once instead of on its tick."""
        self._commands.put(("wake", None))

    # ------------------------------------------------------------------ loop thread
    def _connector_pending(self) -> bool:
        return self._hooks is not None and (self._hooks.has_pending() or bool(self.scheduler.waiting_remote))

    def _settled_now(self) -> bool:
        """Nothing left that close() waits for: no request, and (a decode engine) no load whose ranks
        may still be writing. A prefill engine's lent blocks are not waited for: its readers' loads fail."""
        if self.scheduler.has_work():
            return False
        return self.kv_config is None or self.kv_config.is_producer or not self._connector_pending()

    def _urgent(self) -> bool:
        """The connector has news for the ranks (a lent transfer their peers ask about) or from them."""
        return self._woken or (self._hooks is not None and self._hooks.has_metadata())

    def _loop(self) -> None:
        # The ranks' connectors wake the loop when a transfer event arrives,
        # and the loop steps at once when the scheduler side has news for the
        # ranks. While transfers are outstanding and nothing else runs, it
        # still polls the connector on a backoff (lease expiries, and engines
        # whose connector does not wake it): fast right after a load starts or
        # an event arrives, then doubling up to idle_tick_s. The waits block
        # on the command queue, so new requests and wake-ups end them at once.
        ENGINE.set(self.engine_id)  # this thread's log lines name its engine core (its DP rank's id)
        last_tick = time.monotonic()
        tick = self.args.fast_tick_s
        try:
            while not self._stop.is_set():
                if self.scheduler.has_work() or self._urgent():
                    timeout = 0.0
                elif self._connector_pending():
                    timeout = max(0.0, tick - (time.monotonic() - last_tick))
                else:
                    timeout = 1.0
                self._drain_commands(timeout)
                if self._stop.is_set():
                    break
                if self._settling and self._settled_now():
                    self._settled.set()
                busy = self.scheduler.has_work()
                due = time.monotonic() - last_tick >= tick
                if busy or self._urgent() or (due and self._connector_pending()):
                    self._woken = False
                    progressed = self._step()
                    last_tick = time.monotonic()
                    if busy or progressed:
                        tick = self.args.fast_tick_s
                    else:
                        tick = min(tick * 2, self.args.idle_tick_s)
        except WorkerFailure as exc:
            self._die(str(exc))
        except Exception as exc:  # a bug in the step itself must not leave clients hanging
            self._die(f"engine step failed: {type(exc).__name__}: {exc}", exc)

    def _drain_commands(self, timeout: float) -> None:
        try:
            cmd = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple[str, Any]) -> None:
        kind, payload = cmd
        if kind == "add":
            req: Request = payload
            self._requests[req.request_id] = req
            try:
                self.scheduler.add(req)
            except Exception as exc:  # this request's failure, not the engine's
                self._emit([self.scheduler.fail(req, "submission", exc, connector_saw_it=False)])
                return
            log.debug("request %s queued (%d prompt tokens)", req.request_id, req.num_prompt)
        elif kind == "reject":
            try:
                self._hooks.request_rejected(payload)
            except Exception:  # the producer's lease frees its blocks instead
                log.exception("could not release the producer named by a rejected request's kv_transfer_params")
        elif kind == "wake":
            self._woken = True
        elif kind == "settle":
            self._settling = True
        elif kind == "hurry":
            ended = [rid for rid in list(self._requests) if self.scheduler.abort(rid)]  # releases their KV
            for rid in ended:
                self._requests.pop(rid, None)
                self._sampler.forget(rid)
                self.counters["requests_failed"] += 1
                self._on_output(RequestOutput(rid, finished=True, error="the engine is shutting down",
                                              error_status=503))
            log.info("engine %s: shutdown hurried: %d requests ended", self.engine_id, len(ended))
        elif kind == "abort":
            if self._requests.pop(payload, None) is not None and self.scheduler.abort(payload):
                self.counters["requests_aborted"] += 1
                self._sampler.forget(payload)
                log.info("request %s aborted", payload)

    def _step(self) -> bool:
        """Run one engine step; True if the connector reported any transfer event."""
        sched_out = self.scheduler.schedule()
        meta = self._hooks.build_connector_meta() if self._hooks is not None else None
        chunks = [(c.token_ids, c.start_pos, c.block_ids) for c in sched_out.chunks]
        results = self._executor.execute(chunks, meta)
        now = time.monotonic()
        self.counters["steps"] += 1
        sampled: dict[str, int] = {}
        outputs = list(sched_out.failed)
        logits = results[0].logits
        for i, c in enumerate(sched_out.chunks):
            req = self._requests.get(c.request_id)
            if req is None or logits is None:
                continue
            self.counters["prompt_tokens"] += max(0, min(len(c.token_ids), req.num_prompt - c.start_pos))
            try:
                self._faults.check(FaultStage.SAMPLE, req)
                if req.output_ids:
                    self._faults.check(FaultStage.DECODE, req)
                sampled[c.request_id] = self._sampler.sample(c.request_id, logits[i], req.temperature, req.seed,
                                                             position=len(req.output_ids))
            except Exception as exc:  # this request's failure, not the engine's
                outputs.append(self.scheduler.fail(req, "sampling", exc))
        outputs += self.scheduler.update_from_output(sampled, now)
        self.counters["generation_tokens"] += len(sampled)
        progressed = False
        if self._hooks is not None:
            agg = self._aggregator.aggregate([r.kv_output for r in results])
            events = self._hooks.update_connector_output(agg)
            progressed = not (agg.is_empty() and events.is_empty())
            outputs += self.scheduler.apply_events(events)
        self.worker_stats = [r.stats for r in results]
        for rank, r in enumerate(results):
            if r.routes is not None:
                self.worker_routes[rank] = r.routes
        if self._publisher is not None:
            self._publisher.publish(self.scheduler.blocks.take_events())
        self._emit(outputs)
        return progressed

    def event_stats(self) -> Optional[dict[str, int]]:
        """The KV event publisher's counters (None: events are off)."""
        return self._publisher.snapshot() if self._publisher is not None else None

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand ``outputs`` to the HTTP side; a finished request is forgotten here."""
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
                self._sampler.forget(out.request_id)
                self.counters["requests_failed" if out.error else "requests_ok"] += 1
            self._on_output(out)

    def _die(self, message: str, exc: Optional[BaseException] = None) -> None:
        """Stop for good: one line saying why (a bug's traceback follows it), every request ended with a 503."""
        self.fatal = message
        log.error("engine %s stopping: %s", self.engine_id, message, exc_info=exc)
        for out in self.scheduler.fail_all(message):
            self._on_output(out)
        if self.on_fatal is not None:
            self.on_fatal(message)
