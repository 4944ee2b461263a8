"""Routing policies: which live instance of one pool, and which of its DP ranks, serves a leg.

Each pool (prefill, decode) has its own policy object (``--prefill-policy``,
``--decode-policy``, both defaulting to ``--policy``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from atom_kv.proxy.fleet.registry import Instance
from atom_kv.proxy.routing.base import Policy, RouteContext
from atom_kv.proxy.routing.prefix_tree import PrefixTree

_MASK64 = (1 << 64) - 1
MAX_MATCH_CHARS = 65536  # cache_aware looks at most at this many leading prompt characters


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as text (completions ``prompt`` or chat ``messages``), for prefix routing and estimates."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str):
                return first
            if isinstance(first, list):
                return ",".join(str(t) for t in first)
            return ",".join(str(t) for t in prompt)
        return ""
    parts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def token_id_prompt_lengths(body: dict[str, Any]) -> list[int] | None:
    """Exact prompt lengths when the prompt is token ids (one list, or a batch of lists), else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [len(prompt)]
    if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [len(p) for p in prompt]
    return None


def estimate_prompt_tokens(body: dict[str, Any], text: str | None = None) -> int:
    """len(text)/4 for text prompts, the list length for token-id prompts (at least 1).
    ``text`` is :func:`prompt_text` of ``body`` when the caller already has it."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return max(1, len(prompt))
        total = 0
        for item in prompt:
            if isinstance(item, list):
                total += len(item)
            elif isinstance(item, str):
                total += len(item) // 4
        return max(1, total)
    return max(1, len(prompt_text(body) if text is None else text) // 4)


class RoundRobin(Policy):
    """ATOM's pairing: a counter per pool; each instance cycles its own DP ranks."""

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        n = self._counter
        self._counter = n + 1
        inst = candidates[n % len(candidates)]
        return inst, inst.next_dp_rank()


class RandomChoice(Policy):
    """Uniformly random instance; DP ranks still cycle per instance."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        inst = self._rng.choice(candidates)
        return inst, inst.next_dp_rank()


class PowerOfTwo(Policy):
    """Sample two instances, take the one with fewer in-flight requests."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        if len(candidates) == 1:
            inst = candidates[0]
        else:
            a, b = self._rng.sample(candidates, 2)
            inst = a if a.inflight <= b.inflight else b
        return inst, inst.next_dp_rank()


class LeastLoaded(Policy):
    """The (instance, DP rank) with the fewest outstanding prompt tokens.

    Ties go to the first in address/rank order after the last pick, so equal
    loads still spread. Owns the flat (instance, rank) list of the candidate
    list it was last given, kept while it is given the same list object
    (:meth:`~atom_kv.proxy.fleet.registry.Registry.routable`). A pick walks
    from its starting slot and stops at the first idle one (no load is below 0),
    so it looks at one slot plus the busy ones in its way, not at the whole pool."""

    def __init__(self) -> None:
        self._counter = 0
        self._for: list[Instance] | None = None
        self._slots: list[tuple[Instance, int]] = []

    def _slots_of(self, candidates: list[Instance]) -> list[tuple[Instance, int]]:
        if candidates is not self._for:
            self._for = candidates
            self._slots = [(inst, rank) for inst in candidates for rank in range(len(inst.outstanding_tokens))]
        return self._slots

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        slots = self._slots_of(candidates)
        if not slots:  # only while a dp_size change is being applied
            return candidates[0], 0
        n = len(slots)
        start = self._counter % n
        self._counter += 1
        best, best_load = slots[start], None
        for k in range(n):  # the first least loaded slot in order from start, as min() over the rotation
            slot = slots[(start + k) % n]
            loads = slot[0].outstanding_tokens
            if slot[1] >= len(loads):  # its instance lost ranks to a resize this list was not rebuilt for
                self._for = None
                self._counter -= 1
                return self.choose(candidates, ctx)
            load = loads[slot[1]]
            if best_load is None or load < best_load:
                best, best_load = slot, load
                if load <= 0:
                    break
        return best


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


#: prefixes whose winner :class:`PrefixHash` remembers for its current candidate list
PREFIX_MEMO = 8192


class PrefixHash(Policy):
    """The prompt's first ``prefix_chars`` characters pick the instance by rendezvous
    (highest-random-weight) hashing: stable across proxies, and when an instance
    joins or leaves only the prefixes it wins or held move (no ``hash % n``
    reshuffle). The DP rank comes from the same hash.

    Finding the highest weight looks at every candidate once per prefix: the
    winner of each prefix is remembered (up to :data:`PREFIX_MEMO` of them) for as
    long as the policy is given the same candidate list object
    (:meth:`~atom_kv.proxy.fleet.registry.Registry.routable`), so a prefix seen
    again costs one lookup. A consistent-hash ring would make a new prefix
    O(log N) too, but would move prefixes other proxies' picks still send where
    they are, so the weights stay."""

    uses_text = True

    def __init__(self, prefix_chars: int, memo: int = PREFIX_MEMO) -> None:
        self.prefix_chars = prefix_chars
        self.memo = memo
        self._inst_hash: dict[tuple[str, str], int] = {}
        self._for: list[Instance] | None = None
        self._winners: dict[int, Instance] = {}

    def _weight_seed(self, inst: Instance) -> int:
        h = self._inst_hash.get(inst.key)
        if h is None:
            h = self._inst_hash[inst.key] = _hash64(inst.base_url)
        return h

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        h = _hash64(ctx.text[: self.prefix_chars])
        if candidates is not self._for:
            self._for = candidates
            self._winners = {}
        inst = self._winners.get(h)
        if inst is None:
            inst = max(candidates, key=lambda i: _mix64(h ^ self._weight_seed(i)))
            if len(self._winners) >= self.memo:
                del self._winners[next(iter(self._winners))]  # the oldest
            self._winners[h] = inst
        return inst, (h >> 17) % inst.dp_size

    def forget(self, inst: Instance) -> None:
        self._inst_hash.pop(inst.key, None)
        self._for = None


class CacheAware(Policy):
    """Prefix-cache affinity with a load-balance escape hatch.

    Keeps a :class:`PrefixTree` of routed prompts per instance. When the
    pool is balanced, the instance whose tree matches the longest share of
    the prompt wins if that share is above ``cache_threshold``; otherwise the
    instance with the smallest tree (the most room in its cache) does. When
    the pool is imbalanced (in-flight requests: ``max - min >
    balance_abs_threshold`` and ``max > min * balance_rel_threshold``) the
    least-loaded instance wins. Either way the prompt is recorded in the
    winner's tree.

    A pick looks at every candidate: the balance check reads each one's load and
    the longest match is asked of each one's tree (one tree per instance). That
    scan is what the policy is; ``prefix_hash`` or ``kv_aware`` route on prefixes
    without it, or with a bounded part of it."""

    uses_text = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_chars: int = 4 * 1024 * 1024) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_chars = max_chars
        self.trees: dict[tuple[str, str], PrefixTree] = {}
        self.decisions = {"cache_hit": 0, "cache_miss": 0, "load_balance": 0}
        self._counter = 0

    def _tree(self, inst: Instance) -> PrefixTree:
        tree = self.trees.get(inst.key)
        if tree is None:
            tree = self.trees[inst.key] = PrefixTree(self.max_chars)
        return tree

    def _rotated(self, candidates: list[Instance]) -> list[Instance]:
        start = self._counter % len(candidates)
        self._counter += 1
        return candidates[start:] + candidates[:start]

    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        text = ctx.text[:MAX_MATCH_CHARS]
        loads = [i.inflight for i in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            inst = min(self._rotated(candidates), key=lambda i: i.inflight)
            self.decisions["load_balance"] += 1
        else:
            best, best_len = None, 0
            if text:
                for cand in candidates:
                    matched = self._tree(cand).match(text)
                    if matched > best_len:
                        best, best_len = cand, matched
            if best is not None and best_len / len(text) > self.cache_threshold:
                inst = best
                self.decisions["cache_hit"] += 1
            else:
                inst = min(self._rotated(candidates), key=lambda i: (self._tree(i).size, i.inflight))
                self.decisions["cache_miss"] += 1
        if text:
            self._tree(inst).insert(text)
        return inst, inst.next_dp_rank()

    def forget(self, inst: Instance) -> None:
        self.trees.pop(inst.key, None)


def make_policy(name: str, *, prefix_chars: int = 256, cache_threshold: float = 0.3,
                balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                cache_max_chars: int = 4 * 1024 * 1024, seed: int | None = None, role: str = "P",
                kv_index: Any = None, reported_max_age_s: float | None = None) -> Policy:
    """A fresh policy object for one pool (``role``: "P" or "D"; ``kv_index``: the proxy's
    :class:`~atom_kv.proxy.kv_events.index.KvIndex`, which ``kv_aware`` routes on; ``reported_max_age_s``:
    how old an engine's own load report may be before ``kv_aware`` ignores it, None for its default)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(seed)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_hash":
        return PrefixHash(prefix_chars)
    if name == "cache_aware":
        return CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, cache_max_chars)
    if name == "kv_aware":
        from atom_kv.proxy.routing.kv_aware import KvAware  # it builds on this module's CacheAware

        if kv_index is None:  # a policy of its own (tests, benches): only its own predictions, no engine events
            from atom_kv.proxy.kv_events.index import KvIndex

            kv_index = KvIndex(max_blocks=1 << 16, max_blocks_per_worker=1 << 16)
        aware = CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, cache_max_chars)
        if reported_max_age_s is None:
            return KvAware(role, kv_index, aware)
        return KvAware(role, kv_index, aware, reported_max_age_s=reported_max_age_s)
    raise ValueError(f"policy: unknown policy {name!r}")
