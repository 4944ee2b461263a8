"""The worker API: list, add, drain and remove engines at runtime.

``GET /workers``, ``POST /workers`` (a JSON body), ``POST /workers/drain`` and
``DELETE /workers?url=...``, and sglang-router's query-string aliases
``/list_workers``, ``/add_worker`` and ``/remove_worker``. The routes live in
:mod:`atom_kv.proxy.app` (behind ``--admin-token``); this module checks what
they are given and changes the :class:`~atom_kv.proxy.fleet.registry.Registry`.

An engine added here is checked as a ``--prefill``/``--decode`` spec is
(:func:`~atom_kv.proxy.fleet.static.build_engine`), starts *pending* and is
routed once a health probe reaches it. A drained engine gets no new legs; the
legs it has finish, and ``idle`` says when none is left.
"""

from __future__ import annotations

import builtins
import enum
import time
from typing import Any, Mapping
from urllib.parse import urlsplit

from atom_kv.proxy.fleet.registry import DOWN, PENDING, ROLE_NAMES, Drain, Instance, Origin, Registry
from atom_kv.proxy.fleet.static import Role, StaticEngine, build_engine

__all__ = ["WorkerError", "WorkerState", "Workers", "describe_worker"]

#: what ``role`` (``worker_type`` in the aliases) may say
ROLES: dict[str, Role] = {"prefill": "P", "decode": "D", "P": "P", "D": "D"}
#: POST /workers body fields -> the static spec's keys
_SPEC_KEYS = {"dp_size": "dp", "tp_size": "tp", "engine_id": "engine_id", "notify_port": "notify_port",
              "dp_rank_field": "dp_rank_field"}
_INT_FIELDS = ("handshake_port", "dp_size", "tp_size", "notify_port")
BODY_FIELDS = ("url", "role", "handshake_port", *_SPEC_KEYS, "events")
_NAMES = {"dp": "dp_size", "tp": "tp_size", "HANDSHAKE_PORT": "handshake_port"}
MAX_TEXT = 512  # longest string field accepted (a URL, an engine id, an events endpoint)


class WorkerError(Exception):
    """A worker API request the proxy refuses: ``status`` and a one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class WorkerState(enum.Enum):
    """An engine's state as ``GET /workers`` reports it."""

    PENDING = "pending"  # not reached by a probe yet: not routed
    ACTIVE = "active"  # routed
    DRAINING = "draining"  # no new legs; its in-flight legs finish
    DOWN = "down"  # a probe or a request did not reach it: not routed until a probe does


def worker_state(inst: Instance) -> WorkerState:
    if inst.draining:
        return WorkerState.DRAINING
    if inst.state == PENDING:
        return WorkerState.PENDING
    if inst.state == DOWN:
        return WorkerState.DOWN
    return WorkerState.ACTIVE


def describe_worker(inst: Instance, now: float) -> dict[str, Any]:
    """One engine as ``GET /workers`` lists it."""
    return {
        "id": f"{ROLE_NAMES[inst.role]}@{inst.base_url}",
        "url": inst.base_url,
        "role": ROLE_NAMES[inst.role],
        "source": inst.origin.value,
        "state": worker_state(inst).value,
        "drain": None if inst.drain is None else inst.drain.value,
        "dp_size": inst.dp_size,
        "tp_size": inst.tp_size,
        "handshake_port": inst.handshake_port,
        "engine_id": inst.engine_id,
        "events": inst.reg.kv_events,
        "inflight": inst.inflight,
        "idle": inst.inflight == 0,
        "last_health": {
            "state": inst.state,
            "reason": inst.down_reason or None,
            "at": inst.last_seen_wall or None,
            "age_s": round(now - inst.last_seen, 3) if inst.last_seen else None,
        },
    }


def _base_url(url: object, where: str) -> str:
    if not isinstance(url, str) or not url:
        raise WorkerError(400, f"{where}: `url` is required: the engine's http URL, e.g. http://10.0.0.5:8000")
    if len(url) > MAX_TEXT:
        raise WorkerError(400, f"{where}: `url` is longer than {MAX_TEXT} characters")
    try:
        split = urlsplit(url)
        _ = split.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise WorkerError(400, f"{where}: bad URL {url!r}: {exc}") from None
    if split.scheme not in ("http", "https") or not split.hostname:
        raise WorkerError(400, f"{where}: `url` must be an http URL such as http://10.0.0.5:8000, got {url!r}")
    return f"{split.scheme}://{split.netloc}"


def _role(value: object, key: str, where: str) -> Role:
    role = ROLES.get(value) if isinstance(value, str) else None
    if role is None:
        raise WorkerError(400, f"{where}: `{key}` must be prefill or decode (or P, D), got {value!r}")
    return role


class Workers:
    """The worker API over one registry: owns the checks of what it is given (static-spec rules,
    ``max_tp_size``/``max_dp_size``, at most ``max_instances`` engines added through it)."""

    def __init__(self, registry: Registry, *, max_tp_size: int, max_dp_size: int, max_instances: int) -> None:
        self.registry = registry
        self.max_tp_size = max_tp_size
        self.max_dp_size = max_dp_size
        self.max_instances = max_instances

    # ------------------------------------------------------------------ reads
    def list(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        known = [*self.registry.known("P"), *self.registry.known("D")]
        return [describe_worker(i, now) for i in known]

    def find(self, url: object, role: object = None, where: str = "") -> builtins.list[Instance]:
        """The engines at ``url`` (both roles, unless ``role`` names one); WorkerError 404 if none."""
        base = _base_url(url, where)
        roles: tuple[Role, ...] = ("P", "D") if role is None else (_role(role, "role", where),)
        found = [i for r in roles if (i := self.registry.get(r, base)) is not None]
        if not found:
            raise WorkerError(404, f"{where}: no engine at {base}; GET /workers lists them")
        return found

    # ------------------------------------------------------------------ changes
    def add_body(self, body: object) -> dict[str, Any]:
        """``POST /workers``: a JSON object with the fields of a static spec."""
        where = "POST /workers"
        if not isinstance(body, dict):
            raise WorkerError(400, f"{where}: the body must be a JSON object such as "
                                   '{"url": "http://10.0.0.5:8000", "role": "decode"}')
        unknown = sorted(k for k in body if k not in BODY_FIELDS)
        if unknown:
            raise WorkerError(400, f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(BODY_FIELDS)})")
        return self.add(body, where)

    def add_query(self, args: Mapping[str, str]) -> dict[str, Any]:
        """``/add_worker?url=...&worker_type=prefill|decode[&bootstrap_port=N]`` (sglang-router's PD form)."""
        where = "/add_worker"
        allowed = ("url", "worker_type", "role", "bootstrap_port", "handshake_port", "dp_size")
        unknown = sorted(k for k in args if k not in allowed)
        if unknown:
            raise WorkerError(400, f"{where}: unknown parameter {unknown[0]!r} (allowed: {', '.join(allowed)}; "
                                   "the client's own Authorization header goes to the engines, no api_key)")
        role = args.get("worker_type", args.get("role"))
        if role is None:
            raise WorkerError(400, f"{where}: `worker_type` is required: prefill or decode (every engine here has one)")
        fields: dict[str, Any] = {"url": args.get("url"), "role": role}
        port = args.get("bootstrap_port", args.get("handshake_port"))
        for key, value in (("handshake_port", port), ("dp_size", args.get("dp_size"))):
            if value is not None:
                fields[key] = _query_int(value, key, where)
        return self.add(fields, where)

    def add(self, fields: Mapping[str, Any], where: str) -> dict[str, Any]:
        engine, events = self._engine(fields, where)
        existing = self.registry.get(engine.role, engine.base_url)
        if existing is not None:
            raise WorkerError(409, f"{where}: {ROLE_NAMES[engine.role]} engine {engine.base_url} is already known "
                                   f"(source {existing.origin.value}); DELETE /workers?url=... first to replace it")
        added = sum(1 for r in ("P", "D") for i in self.registry.known(r)
                    if i.origin is Origin.API)
        if added >= self.max_instances:
            raise WorkerError(409, f"{where}: {added} engines were added through the API already (max_instances); "
                                   "remove some first")
        inst = self.registry.add_static(engine, origin=Origin.API)
        return describe_worker(inst, time.monotonic())

    def drain(self, body: object) -> builtins.list[dict[str, Any]]:
        """``POST /workers/drain`` ``{"url": ..., "role": optional}``: no new legs for the engine(s) there."""
        where = "POST /workers/drain"
        if not isinstance(body, dict):
            raise WorkerError(400, f'{where}: the body must be a JSON object such as {{"url": "http://10.0.0.5:8000"}}')
        unknown = sorted(k for k in body if k not in ("url", "role"))
        if unknown:
            raise WorkerError(400, f"{where}: unknown field {unknown[0]!r} (allowed: url, role)")
        found = self.find(body.get("url"), body.get("role"), where)
        for inst in found:
            self.registry.set_drain(inst, Drain.OPERATOR)
        now = time.monotonic()
        return [describe_worker(i, now) for i in found]

    def remove(self, url: object, role: object = None, where: str = "DELETE /workers") -> builtins.list[dict[str, Any]]:
        """Forget the engine(s) at ``url``: their in-flight legs finish; a pinged engine that keeps pinging comes
        back unless it was drained first."""
        found = self.find(url, role, where)
        now = time.monotonic()
        gone = [describe_worker(i, now) for i in found]
        for inst in found:
            self.registry.remove(inst)
        return gone

    # ------------------------------------------------------------------ checks
    def _engine(self, fields: Mapping[str, Any], where: str) -> tuple[StaticEngine, str | None]:
        url = fields.get("url")
        _base_url(url, where)
        if "role" not in fields:
            raise WorkerError(400, f"{where}: `role` is required: prefill or decode")
        role = _role(fields["role"], "role", where)
        spec: dict[str, str] = {}
        for key, spec_key in _SPEC_KEYS.items():
            value = fields.get(key)
            if value is None:
                continue
            if key == "dp_rank_field":
                if not isinstance(value, bool):
                    raise WorkerError(400, f"{where}: `dp_rank_field` must be true or false, got {value!r}")
                value = int(value)
            spec[spec_key] = _text(value, key, where) if key == "engine_id" else _int_text(value, key, where)
        handshake = fields.get("handshake_port")
        events = fields.get("events")
        if events is not None:
            spec["events"] = _text(events, "events", where)  # checked as a spec's events= (tcp://HOST:PORT)
        try:
            engine = build_engine(role, str(url), None if handshake is None else _int_text(handshake, "handshake_port",
                                                                                       where),
                                  spec, where, _NAMES)
        except ValueError as exc:
            raise WorkerError(400, str(exc)) from None
        if engine.tp_size is not None and engine.tp_size > self.max_tp_size:
            raise WorkerError(400, f"{where}: tp_size={engine.tp_size} exceeds --max-tp-size {self.max_tp_size}")
        if engine.dp_size is not None and engine.dp_size > self.max_dp_size:
            raise WorkerError(400, f"{where}: dp_size={engine.dp_size} exceeds --max-dp-size {self.max_dp_size}")
        return engine, events


def _int_text(value: object, key: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkerError(400, f"{where}: `{key}` must be an integer, got {value!r}")
    return str(value)


def _text(value: object, key: str, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise WorkerError(400, f"{where}: `{key}` must be a non-empty string of at most {MAX_TEXT} characters")
    return value


def _query_int(value: str, key: str, where: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise WorkerError(400, f"{where}: `{key}` must be an integer, got {value!r}") from None
