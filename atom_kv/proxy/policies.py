"""Routing policies: which live instance, and which of its DP ranks, serves a leg."""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from atom_kv.proxy.registry import Instance, Role


@dataclass(frozen=True)
class RouteContext:
    """What a policy may look at: the prompt's prefix text and its token estimate."""

    prefix: str
    prompt_tokens: int


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as text (completions ``prompt`` or chat ``messages``), for hashing/estimating."""
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


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """len(text)/4 for text prompts, the list length for token-id prompts (at least 1)."""
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
    return max(1, len(prompt_text(body)) // 4)


class Policy(ABC):
    """Chooses an (instance, dp_rank) among the candidates for one role."""

    uses_prefix = False  # whether choose() looks at RouteContext.prefix

    @abstractmethod
    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        """``candidates`` is non-empty and in stable address order."""


class RoundRobin(Policy):
    """ATOM's pairing: independent P and D counters; each instance cycles its own DP ranks."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {"P": 0, "D": 0}

    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        n = self._counters[role]
        self._counters[role] = n + 1
        inst = candidates[n % len(candidates)]
        return inst, inst.next_dp_rank()


class RandomChoice(Policy):
    """Uniformly random instance; DP ranks still cycle per instance."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        inst = self._rng.choice(candidates)
        return inst, inst.next_dp_rank()


class PowerOfTwo(Policy):
    """Sample two instances, take the one with fewer in-flight requests."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        if len(candidates) == 1:
            inst = candidates[0]
        else:
            a, b = self._rng.sample(candidates, 2)
            inst = a if a.inflight <= b.inflight else b
        return inst, inst.next_dp_rank()


class LeastLoaded(Policy):
    """The (instance, DP rank) with the fewest outstanding prompt tokens.

    Ties go to the first in address/rank order after the last pick, so equal
    loads still spread."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {"P": 0, "D": 0}

    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        slots = [(inst, rank) for inst in candidates for rank in range(inst.dp_size)]
        start = self._counters[role] % len(slots)
        self._counters[role] += 1
        rotated = slots[start:] + slots[:start]
        return min(rotated, key=lambda s: s[0].outstanding_tokens[s[1]])


class PrefixHash(Policy):
    """Prefill: a stable blake2b hash of the prompt's first N characters picks the
    instance (prefix-cache locality). Decode: round robin."""

    uses_prefix = True

    def __init__(self, prefix_chars: int) -> None:
        self.prefix_chars = prefix_chars
        self._decode = RoundRobin()

    def choose(self, role: Role, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        if role != "P":
            return self._decode.choose(role, candidates, ctx)
        digest = hashlib.blake2b(ctx.prefix.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        h = int.from_bytes(digest, "big")
        inst = candidates[h % len(candidates)]
        return inst, (h >> 32) % inst.dp_size


def make_policy(name: str, prefix_chars: int = 256, seed: int | None = None) -> Policy:
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
    raise ValueError(f"policy: unknown policy {name!r}")
