"""Parsers of what an engine says about its own load: its ``/health`` JSON (the reference engine, ATOM
style) and vLLM's Prometheus ``/metrics`` text. Pure functions over bytes the caller has already
bounded in size; :class:`~atom_kv.proxy.fleet.load.LoadReader` calls them.

Both return ``{dp_rank: (requests, prompt_tokens)}``, or None when the answer says nothing about load
(vLLM's empty ``/health``; a ``/metrics`` without vLLM's request gauges), and raise :class:`LoadParseError`
(with a short reason, the counter's label) when it says something malformed.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec

MAX_RANKS = 4096  # DP ranks one answer may list (more: malformed)
MAX_COUNT = 1 << 40  # a request or token count above this is not a count
MAX_SAMPLES = 4096  # series of one vLLM gauge read from one /metrics answer (more: malformed)

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]


class LoadParseError(ValueError):
    """An engine's load report that could not be read; ``reason`` labels the failure counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HealthRequests(msgspec.Struct, frozen=True):
    """``requests`` of a reference engine's ``/health`` (per DP rank, or the engine's total)."""

    running: Count = 0
    waiting: Count = 0
    waiting_remote_kv: Count = 0


class HealthLoad(msgspec.Struct, frozen=True):
    """``load``: the requests given to the rank and not yet answered, and their prompt tokens."""

    requests: Count
    prompt_tokens: Count = 0


class HealthRank(msgspec.Struct, frozen=True):
    """One entry of ``dp_ranks``; fields this proxy does not read are ignored."""

    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    requests: HealthRequests | None = None
    load: HealthLoad | None = None


class HealthBody(msgspec.Struct, frozen=True):
    """The load-related part of an engine's ``/health`` answer (everything else in it is ignored)."""

    dp_ranks: Annotated[list[HealthRank], msgspec.Meta(max_length=MAX_RANKS)] | None = None
    requests: HealthRequests | None = None
    load: HealthLoad | None = None


_health = msgspec.json.Decoder(HealthBody)

Reading = dict[int, tuple[int, int]]


def _of(requests: HealthRequests | None, load: HealthLoad | None) -> tuple[int, int] | None:
    if load is not None:
        return (load.requests, load.prompt_tokens)
    if requests is not None:
        return (requests.running + requests.waiting + requests.waiting_remote_kv, 0)
    return None


def parse_health(raw: bytes) -> Reading | None:
    """The load a ``/health`` body reports per DP rank: ``dp_ranks[i].load`` (else the sum of its
    ``requests``: running, waiting, waiting for remote KV; prompt tokens 0); without ``dp_ranks``, the
    top-level ``load``/``requests`` as rank 0. None: the body is not a JSON object, or names no load."""
    if not raw.lstrip()[:1] == b"{":
        return None  # vLLM: an empty 200; other engines: plain text
    try:
        body = _health.decode(raw)
    except msgspec.ValidationError as exc:
        raise LoadParseError("malformed", f"/health: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise LoadParseError("malformed", f"/health is not JSON: {exc}") from None
    if body.dp_ranks:
        reading: Reading = {}
        for rank in body.dp_ranks:
            value = _of(rank.requests, rank.load)
            if value is not None:
                reading[rank.dp_rank] = value
        return reading or None
    value = _of(body.requests, body.load)
    return None if value is None else {0: value}


_VLLM_GAUGES = (b"vllm:num_requests_running", b"vllm:num_requests_waiting")
_ENGINE = re.compile(rb'(?:^|[{,])\s*engine="(\d{1,6})"')


def _samples(text: bytes, name: bytes):
    """``(labels, value text)`` of every sample line of ``name`` in ``text``, found by search (the other
    lines are never split or looked at)."""
    start = 0
    seen = 0
    while True:
        at = text.find(name, start)
        if at < 0:
            return
        end = text.find(b"\n", at)
        end = len(text) if end < 0 else end
        start = end
        if at > 0 and text[at - 1:at] != b"\n":
            continue  # a comment (# HELP, # TYPE) or the middle of another line
        line = text[at + len(name):end]
        if line[:1] == b"{":
            close = line.find(b"}")
            if close < 0:
                raise LoadParseError("malformed", f"/metrics: {name.decode()} has unclosed labels")
            labels, rest = line[1:close], line[close + 1:]
        elif line[:1] in (b" ", b"\t"):
            labels, rest = b"", line
        else:
            continue  # another metric whose name starts with this one (..._waiting_by_reason)
        seen += 1
        if seen > MAX_SAMPLES:
            raise LoadParseError("malformed", f"/metrics: more than {MAX_SAMPLES} series of {name.decode()}")
        fields = rest.split()
        if not fields:
            raise LoadParseError("malformed", f"/metrics: {name.decode()} has no value")
        yield labels, fields[0]


def _count(value: bytes, name: bytes) -> int:
    try:
        number = float(value)
    except ValueError:
        raise LoadParseError("malformed", f"/metrics: {name.decode()} is not a number: {value[:32]!r}") from None
    if not (math.isfinite(number) and 0 <= number <= MAX_COUNT):
        raise LoadParseError("malformed", f"/metrics: {name.decode()} out of range: {value[:32]!r}")
    return int(number)


def parse_vllm_metrics(text: bytes, dp_size: int) -> Reading | None:
    """Requests running plus waiting per DP rank from vLLM's ``/metrics``: ``vllm:num_requests_running``
    and ``vllm:num_requests_waiting``, summed over ``model_name``; the rank is the ``engine`` label (vLLM's
    engine index, which is the DP rank). Engine indexes that are not ``0..dp_size-1`` (an API server of an
    external or hybrid DP deployment serves ranks from an offset) are taken in order when there are
    ``dp_size`` of them, else summed into rank 0; no ``engine`` label counts as rank 0. vLLM reports no
    prompt tokens still to prefill: 0. None: neither gauge is there."""
    per_engine: dict[int, int] = {}
    found = False
    for name in _VLLM_GAUGES:
        for labels, value in _samples(text, name):
            found = True
            match = _ENGINE.search(labels)
            engine = int(match.group(1)) if match else 0
            per_engine[engine] = per_engine.get(engine, 0) + _count(value, name)
    if not found:
        return None
    engines = sorted(per_engine)
    if all(e < dp_size for e in engines):
        mapped = per_engine
    elif len(engines) == dp_size:
        mapped = {rank: per_engine[e] for rank, e in enumerate(engines)}
    else:
        mapped = {0: sum(per_engine.values())}
    return {rank: (min(requests, MAX_COUNT), 0) for rank, requests in mapped.items()}
