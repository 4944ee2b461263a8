"""Engines named on the command line (``--prefill URL[,HANDSHAKE_PORT]``, ``--decode URL``).

An engine spec is ``URL[,HANDSHAKE_PORT][,key=value...]`` with keys ``tp``,
``dp``, ``engine_id``, ``notify_port``, ``events`` and ``events_replay`` (its KV
event publisher and replay endpoint of DP rank 0, ``tcp://HOST:PORT``; rank N at
port + N): what a registration ping would carry; and ``dp_rank_field`` (``1``:
the engine reads the ``data_parallel_rank`` body field, as ATOM and atom-kv's
reference engine do; ``0``, the default: it gets the rank only in the
``X-data-parallel-rank`` header). Whatever is not given is learnt from the engine (``/health`` reports
``engine_id``, ``tp_size`` and ``dp_size`` on atom-kv's reference engine, ``/v1/models``
reports ``max_model_len``) or left unset. The DP size the engine reports wins over ``dp=``
(a rank the engine lacks would fail every request sent to it); a ``dp=`` that disagrees
is logged once, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from atom_kv.config import is_port
from atom_kv.proxy.kv_events.endpoints import events_endpoint

__all__ = ["Role", "StaticEngine", "as_role", "build_engine", "parse_engine_spec"]

#: an engine's role in a pair: "P" (prefill) or "D" (decode)
Role = Literal["P", "D"]


def as_role(value: object) -> Role | None:
    """``value`` as a :data:`Role`, or None when it is not one."""
    if value == "P":
        return "P"
    if value == "D":
        return "D"
    return None

_KEYS = ("tp", "dp", "engine_id", "notify_port", "dp_rank_field", "events", "events_replay")


@dataclass(frozen=True)
class StaticEngine:
    """One engine given by flag: where it serves HTTP and what we know about it up front."""

    role: Role
    url: str  # as given
    base_url: str  # scheme://host:port
    host: str
    http_port: int
    handshake_port: int | None = None
    tp_size: int | None = None  # None: from the engine's /health, else 1
    dp_size: int | None = None  # None: from the engine's /health, else 1
    engine_id: str | None = None
    notify_port: int | None = None
    dp_rank_field: bool = False
    events: str | None = None  # KV event publisher of DP rank 0 (tcp://HOST:PORT; rank N at port + N)
    events_replay: str | None = None  # ... and its replay endpoint


def _flag(text: str, what: str, where: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{where}: {what} must be 0 or 1, got {text!r}")
    return text == "1"


def _port(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {what} must be a port number, got {text!r}") from None
    if not is_port(value, allow_zero=False):
        raise ValueError(f"{where}: {what} must be 1..65535, got {value}")
    return value


def _positive(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {what} must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{where}: {what} must be >= 1, got {value}")
    return value


def parse_engine_spec(role_name: str, spec: str) -> StaticEngine:
    """Parse one ``--prefill``/``--decode`` value; raises ValueError naming what is wrong."""
    role = as_role(role_name)
    if role is None:
        raise ValueError(f"role must be 'P' or 'D', got {role_name!r}")
    where = repr(spec)
    parts = [p.strip() for p in spec.split(",")]
    fields: dict[str, str] = {}
    handshake: str | None = None
    for i, part in enumerate(parts[1:]):
        key, sep, value = part.partition("=")
        if not sep:
            if i == 0 and part.lower() != "none":
                handshake = part
            elif i != 0 or part.lower() != "none":
                raise ValueError(f"{where}: expected key=value after the URL and handshake port, got {part!r}")
            continue
        key = key.strip()
        if key not in _KEYS:
            raise ValueError(f"{where}: unknown key {key!r} (allowed: {', '.join(_KEYS)})")
        fields[key] = value.strip()
    return build_engine(role, parts[0], handshake, fields, where)


def build_engine(role: Role, url: str, handshake: str | None, fields: dict[str, str], where: str,
                 names: dict[str, str] | None = None) -> StaticEngine:
    """Check one engine's fields (``fields`` keyed as in a spec: ``tp``, ``dp``, ...; ``names``: what the
    caller calls them, for the errors) as a ``--prefill`` spec is checked; ValueError prefixed with ``where``."""
    names = names or {}
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError as exc:
        raise ValueError(f"{where}: bad URL: {exc}") from None
    if split.scheme not in ("http", "https") or not split.hostname:
        raise ValueError(f"{where}: expected an http URL such as http://10.0.0.5:8000, got {url!r}")
    if port is None:
        port = 443 if split.scheme == "https" else 80

    def name(key: str) -> str:
        return names.get(key, key)

    return StaticEngine(
        role=role, url=url, base_url=f"{split.scheme}://{split.netloc}", host=split.hostname, http_port=port,
        handshake_port=None if handshake is None else _port(handshake, name("HANDSHAKE_PORT"), where),
        tp_size=_positive(fields["tp"], name("tp"), where) if "tp" in fields else None,
        dp_size=_positive(fields["dp"], name("dp"), where) if "dp" in fields else None,
        engine_id=fields.get("engine_id") or None,
        notify_port=_port(fields["notify_port"], name("notify_port"), where) if "notify_port" in fields else None,
        dp_rank_field=(_flag(fields["dp_rank_field"], name("dp_rank_field"), where) if "dp_rank_field" in fields
                       else False),
        **_events(fields, where),
    )


def _events(fields: dict[str, str], where: str) -> dict[str, str | None]:
    if "events_replay" in fields and "events" not in fields:
        raise ValueError(f"{where}: events_replay needs events (the publisher's tcp://HOST:PORT) too")
    try:
        return {key: events_endpoint(fields[key], key) if fields.get(key) else None
                for key in ("events", "events_replay")}
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
