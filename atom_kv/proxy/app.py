"""The Quart app: management routes over a :class:`ProxyState` (registry, discovery, health, engine load,
relay, metrics, KV events).

The two completion routes are not Quart's: the proxy's HTTP server
(:mod:`atom_kv.proxy.server`) hands them to ``ProxyState.completions``
(:mod:`atom_kv.proxy.relay.fastpath`) and every other route to this app."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from quart import Quart, Response, request

from atom_kv._netaddr import is_loopback
from atom_kv.auth import same_mac
from atom_kv.logfmt import REQUEST_ID
from atom_kv.proxy.admission.buckets import ClientBuckets
from atom_kv.proxy.fleet.discovery import DiscoveryError, DiscoveryListener
from atom_kv.proxy.fleet.dns import DnsDiscovery, SystemResolver, UdpResolver
from atom_kv.proxy.fleet.health import HealthMonitor, UpstreamHealth
from atom_kv.proxy.fleet.load import LoadReader
from atom_kv.proxy.fleet.registry import STALE_INTERVALS, Instance, Registration, Registry, Role
from atom_kv.proxy.fleet.workers import WorkerError, Workers
from atom_kv.proxy.kv_events import KvEvents, KvEventsConfig
from atom_kv.proxy.observability.metrics import ProxyMetrics, RequestRecord
from atom_kv.proxy.relay.errors import ProxyError
from atom_kv.proxy.relay.fastpath import CompletionsHandler, valid_request_id
from atom_kv.proxy.relay.relay import Relay
from atom_kv.proxy.routing.hf_tokenizer import HfTokenizer
from atom_kv.proxy.routing.policies import Policy, make_policy
from atom_kv.proxy.settings import ProxySettings

if TYPE_CHECKING:
    from atom_kv.proxy.observability.otel import ProxyTracer

logger = logging.getLogger(__name__)

_json_encoder = msgspec.json.Encoder()
STATE_KEY = "atom_kv_proxy"


def _policy(settings: ProxySettings, role: str, kv_events: KvEvents) -> Policy:
    return make_policy(
        settings.policy_for(role), prefix_chars=settings.prefix_chars, cache_threshold=settings.cache_threshold,
        balance_abs_threshold=settings.balance_abs_threshold, balance_rel_threshold=settings.balance_rel_threshold,
        cache_max_chars=settings.cache_max_chars, role=role, kv_index=kv_events.index,
        # a reading is stale after STALE_INTERVALS of --engine-load-interval (the reader's period)
        reported_max_age_s=(STALE_INTERVALS * settings.engine_load_interval_s
                            if settings.engine_load_interval_s > 0 else None),
    )


def _kv_events(settings: ProxySettings) -> KvEvents:
    return KvEvents(KvEventsConfig(
        hwm=settings.kv_events_hwm, max_message_bytes=settings.kv_events_max_message_bytes,
        replay_timeout_s=settings.kv_events_replay_timeout_s, max_blocks=settings.kv_index_max_blocks,
        max_blocks_per_worker=settings.kv_index_max_blocks_per_worker, predict_ttl_s=settings.kv_predict_ttl_s,
        predict_max_blocks=settings.kv_predict_max_blocks, close_timeout_s=settings.shutdown_timeout,
        log_interval_s=settings.log_summary_interval_s))


class ProxyState:
    """Everything one proxy owns. Its lifespan (``start``/``stop``, called only by the
    app's serving hooks) is the one owner of discovery, health monitoring and the relay's
    upstream session."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.metrics = ProxyMetrics()
        # what the engines cache, from their KV events (its thread starts with the first engine that has some)
        self.kv_events = _kv_events(settings)
        self._following = False  # set at start: from then on an added engine's KV events are followed
        self.metrics.registry.register(self.kv_events.collector())
        self.policies: dict[str, Policy] = {role: _policy(settings, role, self.kv_events) for role in ("P", "D")}
        # --tokenizer: loaded here, so a bad path stops the start in one line (TokenizerError)
        tokenizer = HfTokenizer(settings.tokenizer) if settings.tokenizer is not None else None
        self.registry = Registry(settings.heartbeat_timeout, settings.circuit_failures, settings.circuit_cooldown_s,
                                 max_instances=settings.max_instances, on_evict=self._forget,
                                 on_register=self._registered, on_added=self._added,
                                 circuit_min_requests=settings.circuit_min_requests,
                                 circuit_failure_ratio=settings.circuit_failure_ratio,
                                 circuit_window_s=settings.circuit_window_s)
        for engine in (*settings.static_prefill, *settings.static_decode):
            self.registry.add_static(engine)
        self.health = UpstreamHealth(self.registry, self.metrics)
        # what each engine says it runs, whoever sent it (read off the request path; also from the probes' /health)
        self.load_reader = LoadReader(
            self.registry, self.metrics, interval_s=settings.engine_load_interval_s,
            timeout_s=settings.engine_load_timeout, connect_timeout=settings.connect_timeout,
            max_bytes=settings.engine_load_max_bytes, log_interval_s=settings.log_summary_interval_s)
        self.monitor = HealthMonitor(
            self.registry, self.health, interval_s=settings.probe_interval_s,
            timeout_s=settings.probe_timeout, connect_timeout=settings.connect_timeout,
            tick_s=min(settings.probe_interval_s, settings.heartbeat_timeout / 4), max_dp_size=settings.max_dp_size,
            on_health=self.load_reader.take_health,
        )
        self.discovery: DiscoveryListener | None = None
        if settings.discovery:
            self.discovery = DiscoveryListener(
                settings.discovery_bind_host, settings.discovery_port, self.registry, self.metrics,
                registration_token=settings.registration_token, allow_open=settings.allow_open_registration,
                window_s=settings.registration_window_s,
                max_connections=settings.discovery_max_connections,
                max_connections_per_source=settings.discovery_max_connections_per_source,
                max_tp_size=settings.max_tp_size, max_dp_size=settings.max_dp_size,
                poll_s=min(settings.discovery_poll_s, settings.heartbeat_timeout / 2),
                log_interval_s=settings.log_summary_interval_s,
            )
        self.relay = Relay(settings, self.registry, self.policies, self.health, self.metrics,
                           kv_index=self.kv_events.index, tokenizer=tokenizer)
        buckets = None if settings.rate_limit is None else ClientBuckets(
            *settings.rate_limit, max_clients=settings.rate_limit_clients)
        self.dns = DnsDiscovery(
            [*settings.prefill_dns, *settings.decode_dns], self.registry,
            UdpResolver(settings.dns_server, settings.dns_timeout) if settings.dns_server is not None
            else SystemResolver(settings.dns_timeout), settings.dns_interval_s,
            log_interval_s=settings.log_summary_interval_s)
        self.workers = Workers(self.registry, max_tp_size=settings.max_tp_size, max_dp_size=settings.max_dp_size,
                               max_instances=settings.max_instances)
        self.completions = CompletionsHandler(self.relay, self.metrics, buckets)
        # --otlp-traces-endpoint: made at start (a test may set its own before); None: tracing is off
        self.tracer: ProxyTracer | None = None
        self.started = asyncio.Event()

    def _forget(self, inst: Instance) -> None:
        """An instance left (silent past the heartbeat, dropped to make room, or removed by the worker API or
        DNS): count it and let the policies and the KV index forget it (a static engine that went silent, still
        registered, keeps its cache estimate, but what its index held while silent is not trusted)."""
        self.metrics.evictions.labels("prefill" if inst.role == "P" else "decode").inc()
        if self.registry.get(inst.role, inst.base_url) is not inst:  # gone from the registry
            for policy in self.policies.values():
                policy.forget(inst)
            self.kv_events.forget(inst.key)
        else:  # a static engine gone silent: still followed, its entries start afresh
            self.kv_events.reset(inst.key)

    def _added(self, inst: Instance) -> None:
        """An engine given by flag, the worker API or DNS: follow the KV events its spec names (once started)."""
        if self._following and inst.reg.kv_events is not None:
            self.kv_events.watch(inst.key, inst.reg.kv_events, inst.reg.kv_events_replay, dp_size=inst.dp_size,
                                 engine_id=inst.reg.engine_id)

    def _registered(self, inst: Instance, reg: Registration) -> None:
        """A ping: follow the KV events it announces (the same announcement again costs a comparison; a new
        engine id, a restart, clears what the instance held)."""
        if reg.kv_events is not None:
            self.kv_events.watch(inst.key, reg.kv_events, reg.kv_events_replay, dp_size=reg.dp_size,
                                 engine_id=reg.engine_id)
        else:
            self.kv_events.forget(inst.key)

    async def start(self) -> None:
        try:
            if self.tracer is None and self.settings.otlp_traces_endpoint is not None:
                from atom_kv.proxy.observability.otel import ProxyTracer  # only with the flag: the SDK is optional
                self.tracer = ProxyTracer(self.settings.otlp_traces_endpoint, timeout_s=self.settings.otlp_timeout_s,
                                          log_interval_s=self.settings.log_summary_interval_s)
            self.completions.tracer = self.tracer
            await self.relay.start()
            await self.monitor.start()
            await self.load_reader.start()
            self._following = True  # engines added from here on (API, DNS) are followed as they come
            for role in ("P", "D"):
                for inst in self.registry.known(role):
                    self._added(inst)
            if self.discovery is not None:
                await self.discovery.start()  # raises DiscoveryError with a one-line reason
            await self.dns.start()
        except BaseException:
            await self.stop()
            raise
        logger.info(
            "proxy ready on http://%s:%d%s; prefill policy %s, decode policy %s; %d static engine(s)",
            self.settings.host, self.settings.port,
            f", discovery on tcp://{self.discovery.host}:{self.discovery.port}" if self.discovery else "",
            self.settings.policy_for("P"), self.settings.policy_for("D"),
            len(self.settings.static_prefill) + len(self.settings.static_decode),
        )
        self.started.set()

    async def stop(self) -> None:
        await self.dns.close()
        if self.discovery is not None:
            await self.discovery.close()
        await self.monitor.close()
        await self.load_reader.close()
        await asyncio.to_thread(self.kv_events.close)  # joins the subscriber thread (bounded)
        await self.relay.close()
        tracer, self.tracer = self.tracer, None
        self.completions.tracer = None
        if tracer is not None:  # every request is over: its spans are queued; flush them, bounded
            await tracer.aclose(self.settings.shutdown_timeout)


def _not_ready_reason(registry: Registry, counts: dict[str, int]) -> str:
    """Why no pair is usable, one clause per role that has no usable engine."""
    clauses = []
    roles: tuple[tuple[Role, str], ...] = (("P", "prefill"), ("D", "decode"))
    for role, name in roles:
        if counts[name] > 0:
            continue
        known = len(registry.known(role))
        clauses.append(f"no {name} engine known" if known == 0 else
                       f"none of the {known} known {name} engine(s) is usable (/instances has each one's state)")
    return "; ".join(clauses)


def _json_response(status: int, payload: Any, request_id: str | None = None) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(_json_encoder.encode(payload), status=status, headers=headers, content_type="application/json")


def _error_response(err: ProxyError, request_id: str | None = None) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(err.body(), status=err.status, headers=headers, content_type="application/json")


class _ProxyQuart(Quart):
    def log_exception(self, exception_info) -> None:
        if isinstance(exception_info[1], DiscoveryError):
            return  # a start-up failure the command line reports in one line
        super().log_exception(exception_info)


def create_app(settings: ProxySettings) -> Quart:
    """Build a proxy app. Its state is at ``app.extensions["atom_kv_proxy"]``."""
    app = _ProxyQuart("atom_kv.proxy")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = settings.body_timeout
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["PROPAGATE_EXCEPTIONS"] = False
    state = ProxyState(settings)
    app.extensions[STATE_KEY] = state
    metrics = state.metrics

    @app.before_serving
    async def _startup() -> None:
        await state.start()

    @app.after_serving
    async def _shutdown() -> None:
        await state.stop()

    @app.get("/v1/models")
    async def models() -> Response:
        record = RequestRecord(metrics, "/v1/models")
        request_id = valid_request_id(request.headers.get("X-Request-Id"))
        REQUEST_ID.set(request_id)  # this exchange runs in its own task: its log lines carry the id
        try:
            result = await state.relay.models(request_id, request.headers.get("Authorization"))
        except ProxyError as err:
            record.finish(err.status)
            logger.info("[%s] /v1/models -> %d: %s", request_id, err.status, err.logged)
            return _error_response(err, request_id)
        record.finish(result.status)
        return Response(result.body or b"", status=result.status, headers={"X-Request-Id": request_id},
                        content_type=result.content_type)

    @app.get("/health")
    async def health() -> Response:
        counts = state.registry.counts()
        ok = counts["prefill"] > 0 and counts["decode"] > 0
        return _json_response(200 if ok else 503, {"status": "ok" if ok else "unavailable", **counts})

    # The probes, open like /health (a kubelet's or a balancer's probe carries no token; they tell only
    # whether the proxy can serve), and behind the Host check like every route.
    @app.get("/readiness")
    async def readiness() -> Response:
        """200 while a request can be routed (what /health counts: a usable prefill and decode engine),
        else 503 with the reason in one line."""
        counts = state.registry.counts()
        if counts["prefill"] > 0 and counts["decode"] > 0:
            return _json_response(200, {"status": "ready", **counts})
        return _json_response(503, {"status": "not ready", "reason": _not_ready_reason(state.registry, counts),
                                    **counts})

    @app.get("/liveness")
    async def liveness() -> Response:
        """200 whenever the event loop gets to answer: the process serves (it says nothing about engines)."""
        return _json_response(200, {"status": "alive"})

    def _admin_refusal() -> Response | None:
        """With ``--admin-token``, the management routes answer only ``Authorization: Bearer <token>``."""
        if settings.admin_token is None:
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and same_mac(settings.admin_token, token.strip()):
            return None
        return Response(ProxyError(401, f"{request.path} needs the admin token (Authorization: Bearer ...)").body(),
                        status=401, headers={"WWW-Authenticate": "Bearer"}, content_type="application/json")

    @app.get("/instances")
    async def instances() -> Response:
        return _admin_refusal() or _json_response(200, state.registry.snapshot())

    # ------------------------------------------------------------------ the worker API (atom_kv.proxy.fleet.workers)
    def _change_refusal() -> Response | None:
        """The routes that change the engines: the admin token, and without one only on a loopback proxy
        (anyone who reaches a wider address could otherwise send every client's requests to an engine of theirs)."""
        if settings.admin_token is None and not is_loopback(settings.host):
            return _error_response(ProxyError(403, f"{request.path} changes the proxy's engines: it needs "
                                                   "--admin-token-file when the proxy listens beyond loopback"))
        return _admin_refusal()

    def _workers_error(err: WorkerError) -> Response:
        return _error_response(ProxyError(err.status, err.message))

    async def _json_body() -> object:
        data = await request.get_data()
        try:
            return msgspec.json.decode(data) if data else None
        except msgspec.DecodeError:
            raise WorkerError(400, f"{request.method} {request.path}: the body is not JSON") from None

    @app.get("/workers")
    async def list_workers() -> Response:
        return _admin_refusal() or _json_response(200, {"workers": state.workers.list()})

    @app.post("/workers")
    async def add_worker() -> Response:
        if (refusal := _change_refusal()) is not None:
            return refusal
        try:
            return _json_response(201, state.workers.add_body(await _json_body()))
        except WorkerError as err:
            return _workers_error(err)

    @app.post("/workers/drain")
    async def drain_worker() -> Response:
        if (refusal := _change_refusal()) is not None:
            return refusal
        try:
            return _json_response(200, {"workers": state.workers.drain(await _json_body())})
        except WorkerError as err:
            return _workers_error(err)

    @app.delete("/workers")
    async def remove_worker() -> Response:
        if (refusal := _change_refusal()) is not None:
            return refusal
        try:
            return _json_response(200, {"removed": state.workers.remove(
                request.args.get("url"), request.args.get("role"))})
        except WorkerError as err:
            return _workers_error(err)

    # sglang-router's forms: /add_worker?url=...&worker_type=prefill|decode[&bootstrap_port=N],
    # /remove_worker?url=..., /list_workers
    @app.post("/add_worker")
    async def sglang_add_worker() -> Response:
        if (refusal := _change_refusal()) is not None:
            return refusal
        try:
            return _json_response(200, state.workers.add_query(request.args))
        except WorkerError as err:
            return _workers_error(err)

    @app.post("/remove_worker")
    async def sglang_remove_worker() -> Response:
        if (refusal := _change_refusal()) is not None:
            return refusal
        try:
            return _json_response(200, {"removed": state.workers.remove(
                request.args.get("url"), request.args.get("worker_type"), "/remove_worker")})
        except WorkerError as err:
            return _workers_error(err)

    @app.get("/list_workers")
    async def sglang_list_workers() -> Response:
        if (refusal := _admin_refusal()) is not None:
            return refusal
        workers = state.workers.list()
        return _json_response(200, {"urls": sorted({w["url"] for w in workers}),
                                    "prefill": [w["url"] for w in workers if w["role"] == "prefill"],
                                    "decode": [w["url"] for w in workers if w["role"] == "decode"]})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        registry = state.registry
        return _admin_refusal() or Response(
            metrics.render(registry.counts(), [*registry.known("P"), *registry.known("D")]),
            status=200, content_type=metrics.content_type)

    @app.errorhandler(404)
    async def _not_found(_: Exception) -> Response:
        return _error_response(ProxyError(404, f"no route for {request.method} {request.path}"))

    @app.errorhandler(405)
    async def _bad_method(_: Exception) -> Response:
        return _error_response(ProxyError(405, f"method {request.method} not allowed on {request.path}"))

    @app.errorhandler(413)
    async def _too_large(_: Exception) -> Response:
        return _error_response(ProxyError(413, f"request body exceeds {settings.max_request_bytes} bytes"))

    @app.errorhandler(Exception)
    async def _internal(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ProxyError(500, f"internal proxy error: {type(exc).__name__}"))

    return app
