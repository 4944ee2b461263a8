"""``bench routing``'s multi-turn workload: the conversations it sends, the working set it needs, and the oracle.

A :class:`Plan` is C conversations of T turns over S system prompts (conversation ``c`` opens with system
prompt ``c % S``, so every system prompt is shared by several conversations). Turn ``t`` of a conversation
sends everything so far (system prompt, every earlier user message and answer) plus a new user message; the
answer (``answer_tokens`` greedy tokens) is appended before the next turn. All text is printable ASCII, which
the reference engine's byte tokenizer maps one token per byte (plus its BOS), so the plan knows each prompt's
length before it is sent.

:class:`PrefixOracle` is the hit rate a perfect router would get with caches that never evict: each
request's prompt is matched against every token sequence whose KV was computed by an earlier request (its
prompt and its answer but the last token, the one never fed back), in whole blocks and short of the block of
its last token, as the engine's prefix cache matches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = ["Plan", "PrefixOracle", "Turn", "working_set_blocks"]

_WORDS = ("block", "cache", "prefix", "decode", "prefill", "token", "route", "engine", "tensor", "layer",
          "paged", "batch", "stream", "queue", "index", "event", "shard", "rank", "proxy", "reply")


def _text(rng: random.Random, head: str, chars: int) -> str:
    """``head`` followed by words drawn from ``rng`` to exactly ``chars`` characters (at least ``head``)."""
    out = head
    while len(out) < chars:
        out += rng.choice(_WORDS) + " "
    return out[:max(chars, len(head))]


@dataclass(frozen=True)
class Turn:
    """One request of the plan: which conversation and turn, and the user message it adds."""

    conversation: int
    turn: int  # 1-based
    user: str


@dataclass
class Plan:
    """The workload: its system prompts, each conversation's user messages, and the order of each turn's
    requests (interleaved: every conversation's turn ``t`` before any turn ``t + 1``, shuffled)."""

    conversations: int
    turns: int
    system_prompts: int
    system_chars: int
    user_chars: int
    answer_tokens: int
    seed: int = 0
    systems: list[str] = field(init=False)
    users: list[list[str]] = field(init=False)  # [conversation][turn - 1]

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.systems = [_text(rng, f"System {s}: you are assistant number {s}. ", self.system_chars)
                        for s in range(self.system_prompts)]
        self.users = [[_text(rng, f"\nUser {c}.{t}: ", self.user_chars) + "\nAssistant:"
                       for t in range(1, self.turns + 1)] for c in range(self.conversations)]

    def system_of(self, conversation: int) -> str:
        return self.systems[conversation % self.system_prompts]

    def turn_order(self, turn: int) -> list[Turn]:
        """Turn ``turn``'s requests in the order they are sent (a fixed shuffle per turn)."""
        order = list(range(self.conversations))
        random.Random(self.seed * 1000 + turn).shuffle(order)
        return [Turn(c, turn, self.users[c][turn - 1]) for c in order]

    def longest_request_tokens(self) -> int:
        """Prompt and answer tokens of the longest request (the last turn), by the byte tokenizer's count."""
        users = max(sum(len(u) for u in conv) for conv in self.users)
        return 1 + self.system_chars + users + self.turns * self.answer_tokens

    def estimated_sequences(self) -> Iterable[list[int]]:
        """Each conversation's final token sequence as the byte tokenizer makes it, with placeholder answers
        (an answer's bytes differ per conversation, as real ones do, so its blocks are the conversation's own)."""
        for c in range(self.conversations):
            text = self.system_of(c) + "".join(u + chr(33 + c % 90) * self.answer_tokens for u in self.users[c])
            yield [-1, *text.encode()]  # -1: the BOS, not a byte


def working_set_blocks(sequences: Iterable[list[int]], block_size: int) -> int:
    """Distinct full blocks over ``sequences`` (a block is its whole prefix: the chain the caches key on)."""
    seen: set[int] = set()
    for tokens in sequences:
        key = 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = hash((key, tuple(tokens[start:start + block_size])))
            seen.add(key)
    return len(seen)


class PrefixOracle:
    """The hit rate if every request met its whole earlier prefix: requests are offered in the order they were
    sent, each matched against the computed KV of every request offered before it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._known: set[int] = set()  # chained keys of every full block computed so far
        self.queries = 0
        self.hits = 0

    def _keys(self, tokens: list[int], limit: Optional[int] = None) -> Iterable[int]:
        key, bs = 0, self.block_size
        n = len(tokens) // bs if limit is None else limit
        for i in range(n):
            key = hash((key, tuple(tokens[i * bs:(i + 1) * bs])))
            yield key

    def offer(self, prompt: list[int], computed: list[int]) -> int:
        """Count one request: ``prompt``'s tokens, and ``computed`` (its prompt and answer tokens whose KV it
        left, a sequence that starts with ``prompt``). Returns the tokens it would have found cached."""
        matchable = (len(prompt) - 1) // self.block_size  # never the block of the last prompt token
        hit = 0
        for key in self._keys(prompt, matchable):
            if key not in self._known:
                break
            hit += 1
        self.queries += len(prompt)
        self.hits += hit * self.block_size
        self._known.update(self._keys(computed))
        return hit * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
