"""The Quart app: HTTP routes over a :class:`ProxyState` (registry, discovery, relay, metrics)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from quart import Quart, Response, request

from atom_kv.proxy.discovery import DiscoveryListener
from atom_kv.proxy.errors import ProxyError
from atom_kv.proxy.fastpath import CompletionsASGI, valid_request_id
from atom_kv.proxy.metrics import ProxyMetrics
from atom_kv.proxy.policies import make_policy
from atom_kv.proxy.registry import Registry
from atom_kv.proxy.relay import Relay
from atom_kv.proxy.settings import ProxySettings

logger = logging.getLogger(__name__)

_json_encoder = msgspec.json.Encoder()
STATE_KEY = "atom_kv_proxy"


class ProxyState:
    """Everything one proxy owns; started and stopped with the app's lifespan."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.metrics = ProxyMetrics()
        self.registry = Registry(settings.heartbeat_timeout, settings.circuit_failures, settings.circuit_cooldown_s)
        self.policy = make_policy(settings.policy, settings.prefix_chars)
        self.discovery = DiscoveryListener(
            settings.discovery_host, settings.discovery_port, self.registry, self.metrics,
            registration_token=settings.registration_token, poll_s=min(settings.discovery_poll_s, settings.heartbeat_timeout / 2),
        )
        self.relay = Relay(settings, self.registry, self.policy, self.metrics)

    async def start(self) -> None:
        self.discovery.start()
        await self.relay.start()

    async def stop(self) -> None:
        await self.relay.close()
        await asyncio.to_thread(self.discovery.close)


def _json_response(status: int, payload: Any, request_id: str | None = None) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(_json_encoder.encode(payload), status=status, headers=headers, content_type="application/json")


def _error_response(err: ProxyError, request_id: str | None = None) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(err.body(), status=err.status, headers=headers, content_type="application/json")


def create_app(settings: ProxySettings) -> Quart:
    """Build a proxy app. Its state is at ``app.extensions["atom_kv_proxy"]``."""
    app = Quart("atom_kv.proxy")
    app.config["RESPONSE_TIMEOUT"] = None
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

    def _request_id() -> str:
        return valid_request_id(request.headers.get("X-Request-Id"))

    def _count(endpoint: str, status: int, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.duration.labels(endpoint).observe(elapsed)
        metrics.ttfb.labels(endpoint).observe(elapsed)

    @app.get("/v1/models")
    async def models() -> Response:
        t0 = time.perf_counter()
        request_id = _request_id()
        try:
            result = await state.relay.models(request_id, request.headers.get("Authorization"))
        except ProxyError as err:
            _count("/v1/models", err.status, t0)
            return _error_response(err, request_id)
        _count("/v1/models", result.status, t0)
        return Response(result.body or b"", status=result.status, headers={"X-Request-Id": request_id},
                        content_type=result.content_type)

    @app.get("/health")
    async def health() -> Response:
        counts = state.registry.counts()
        ok = counts["prefill"] > 0 and counts["decode"] > 0
        return _json_response(200 if ok else 503, {"status": "ok" if ok else "unavailable", **counts})

    @app.get("/instances")
    async def instances() -> Response:
        return _json_response(200, state.registry.snapshot())

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(state.registry.counts()), status=200, content_type=metrics.content_type)

    @app.errorhandler(404)
    async def _not_found(_: Exception) -> Response:
        return _error_response(ProxyError(404, f"no route for {request.method} {request.path}"))

    @app.errorhandler(405)
    async def _bad_method(_: Exception) -> Response:
        return _error_response(ProxyError(405, f"method {request.method} not allowed on {request.path}"))

    @app.errorhandler(413)
    async def _too_large(_: Exception) -> Response:
        return _error_response(ProxyError(400, "request body too large"))

    @app.errorhandler(Exception)
    async def _internal(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ProxyError(500, f"internal proxy error: {type(exc).__name__}"))

    # the two relay routes are served as plain ASGI in front of Quart (see fastpath.py)
    app.asgi_app = CompletionsASGI(app.asgi_app, state.relay, metrics, settings.max_request_bytes)  # type: ignore[method-assign]
    return app
