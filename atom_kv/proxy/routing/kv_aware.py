"""``kv_aware``: route a leg to the (instance, DP rank) whose KV cache already holds the most of the prompt,
traded against its load, from what the engines' KV events say they hold (:mod:`atom_kv.proxy.kv_events`).

The cost of sending a prompt of ``n`` tokens to one (instance, DP rank), in KV blocks of that rank's block
size ``bs`` (Dynamo's KV router's shape; docs/routing.md gives the same function and its constants):

    uncached = ceil(n / bs) - cached_tokens // bs            blocks to compute (prefill) or to read (decode)
    queued   = max(own_tokens, reported_prompt_tokens) / bs  work already waiting there
    requests = max(own_requests, reported_requests)
    cost     = uncached + LOAD_WEIGHT[leg] * (queued + REQUEST_BLOCKS * requests)

``own_*`` are this proxy's legs in flight on that rank (``Instance.outstanding_tokens/requests``; a
``kv_aware`` prefill leg is charged only the tokens it computes there, :meth:`KvAware.charged_tokens`);
``reported_*`` the engine's own report (``Instance.reported_load``), which also sees other proxy replicas and
traffic that bypasses the proxy. A report older than :data:`REPORTED_LOAD_MAX_AGE_S` is ignored. Taking the
larger of the two views counts neither twice nor too little.

The lowest cost wins. Equal costs go to the highest rendezvous weight of (the prompt's first
:data:`TIE_TOKENS` token ids, the instance's ``base_url`` and the rank), a blake2b of bytes every proxy
replica sees alike, so two proxies with the same state pick the same rank (the index's own chain keys are
keyed per process and could not do this). The winner is recorded as holding the prompt
(:meth:`~atom_kv.proxy.kv_events.index.KvIndex.record`, predict-on-route) until its events arrive, so a
burst of siblings finds it.

A pick scores every candidate rank: a rank the index does not name still competes on its load and its tie
weight, so which of the unnamed ranks wins cannot be known without looking at each (docs/routing.md, "What a
pick costs"). The index lookup itself is one walk of the prompt's keys, whatever the fleet's size.

Without the prompt's token ids (no ``--tokenizer``, no engine ``/tokenize`` and a text prompt) the policy
routes as ``cache_aware`` does and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from typing import Any, Callable, Sequence

from atom_kv.proxy.fleet.registry import Instance, ReportedLoad
from atom_kv.proxy.routing.base import Policy, RouteContext

__all__ = ["KvAware", "LOAD_WEIGHT", "REPORTED_LOAD_MAX_AGE_S", "REQUEST_BLOCKS", "TIE_TOKENS", "rank_cost",
           "tie_weight"]

logger = logging.getLogger(__name__)

#: per leg, what one block of work already queued on a rank costs against one block of the prompt not cached
#: there (docs/routing.md says why). Prefill: below 1 (Dynamo uses 1), a prompt follows the rank holding its
#: prefix until that rank's queue is four times what it saves there. Decode: a decode's "queue" is mostly KV
#: its running requests hold, not work ahead of the new one, so locality weighs more
LOAD_WEIGHT = {"P": 0.25, "D": 0.1}
#: what each request in flight or queued on a rank adds to its queue, in blocks (scheduling and decode steps
#: that prompt tokens do not show; the only load signal of an engine that reports requests but no tokens)
REQUEST_BLOCKS = 1.0
#: an engine's load report older than this (seconds) is stale: only the proxy's own count is used
REPORTED_LOAD_MAX_AGE_S = 10.0
#: the leading prompt tokens hashed for the tie-break
TIE_TOKENS = 64

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prompt_tie_hash(token_ids: Sequence[int]) -> int:
    """The prompt's part of the tie-break: the same in every proxy process."""
    try:
        data = array("I", token_ids[:TIE_TOKENS]).tobytes()
    except (OverflowError, TypeError):
        data = repr(list(token_ids[:TIE_TOKENS])).encode()
    return _blake64(data)


def tie_weight(prompt_hash: int, base_url: str, rank: int) -> int:
    """Rendezvous weight of one (instance, rank) for one prompt: the highest wins a tie."""
    return _mix64(prompt_hash ^ _blake64(f"{base_url}#{rank}".encode("utf-8", "surrogatepass")))


def reported(inst: Instance, rank: int, now: float, max_age_s: float) -> ReportedLoad | None:
    """The engine's own load report of ``rank`` when there is a fresh one, else None."""
    loads = inst.reported_load
    found = loads[rank] if rank < len(loads) else None
    if found is None or not now - found.at <= max_age_s:
        return None
    return found


def rank_cost(leg: str, prompt_tokens: int, cached_tokens: int, block_size: int, own_tokens: int,
              own_requests: int, report: ReportedLoad | None) -> float:
    """The module doc's cost of one (instance, DP rank), in blocks (lower is better)."""
    uncached = -(-prompt_tokens // block_size) - cached_tokens // block_size
    queued_tokens, requests = own_tokens, own_requests
    if report is not None:
        queued_tokens = max(queued_tokens, report.prompt_tokens)
        requests = max(requests, report.requests)
    return max(0, uncached) + LOAD_WEIGHT[leg] * (queued_tokens / block_size + REQUEST_BLOCKS * requests)


class KvAware(Policy):
    """Picks by :func:`rank_cost` over the proxy's KV index (``kv_index``, shared by both pools' policies) and
    records each pick there; owns the policy it falls back to without token ids (``cache_aware``)."""

    uses_text = True  # the fallback reads the text
    uses_token_ids = True

    def __init__(self, role: str, kv_index: Any, fallback: Policy, *,
                 reported_max_age_s: float = REPORTED_LOAD_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if role not in LOAD_WEIGHT:
            raise ValueError(f"role: must be 'P' or 'D', got {role!r}")
        self.role = role
        self.index = kv_index
        self.fallback = fallback
        self.reported_max_age_s = reported_max_age_s
        self._clock = clock
        self.fallbacks = 0  # picks made by the fallback (no token ids)
        self.decisions = {"cache_hit": 0, "no_hit": 0, "fallback": 0}
        self._last: tuple[RouteContext, tuple[str, str], int, int] | None = None  # the last pick's cached tokens

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        keys = ctx.prompt_keys
        if keys is None or not ctx.token_ids:
            if not self.fallbacks:
                logger.info("kv_aware (%s leg): no token ids for a prompt (give --tokenizer, or engines with "
                            "/tokenize); routing such prompts as cache_aware", "prefill" if self.role == "P"
                            else "decode")
            self.fallbacks += 1
            self.decisions["fallback"] += 1
            return self.fallback.choose(candidates, ctx)
        held = self.index.longest_prefix(keys)
        n = len(ctx.token_ids)
        tie = prompt_tie_hash(ctx.token_ids)
        now = self._clock()
        best: tuple[float, int] | None = None
        winner: tuple[Instance, int] = (candidates[0], 0)
        best_cached = 0
        for inst in candidates:
            key = inst.key
            for rank in range(min(inst.dp_size, len(inst.outstanding_tokens))):
                cached = held.get((key, rank), 0)
                cost = rank_cost(self.role, n, cached, self.index.block_size_of(key, rank),
                                 inst.outstanding_tokens[rank], inst.outstanding_requests[rank],
                                 reported(inst, rank, now, self.reported_max_age_s))
                score = (cost, -tie_weight(tie, inst.base_url, rank))
                if best is None or score < best:
                    best, winner, best_cached = score, (inst, rank), cached
        self.decisions["cache_hit" if best_cached else "no_hit"] += 1
        self.index.record(winner[0].key, winner[1], keys)
        self._last = (ctx, winner[0].key, winner[1], best_cached)
        return winner

    def charged_tokens(self, inst: Instance, rank: int, ctx: RouteContext, tokens: int) -> int:
        """A prefill leg loads its rank with the prompt tokens it computes there, not those it found cached
        (Dynamo's "in-flight uncached prefill tokens"); a decode leg with its whole prompt, whose KV it holds
        while it decodes."""
        last, self._last = self._last, None
        if self.role != "P" or last is None or last[0] is not ctx or last[1] != inst.key or last[2] != rank:
            return tokens
        return max(1, tokens - last[3])

    def forget(self, inst: Instance) -> None:
        self.fallback.forget(inst)
