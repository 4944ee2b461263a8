"""What every routing policy is (:class:`Policy`) and what it may look at (:class:`RouteContext`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

from atom_kv.proxy.fleet.registry import Instance

__all__ = ["Policy", "RouteContext"]


@dataclass(frozen=True)
class RouteContext:
    """What a policy may look at: the prompt as text, its token count (an estimate unless ``token_ids`` is
    known) and, when the relay learnt them (``Policy.uses_token_ids``), its token ids and their KV index keys
    (a :class:`~atom_kv.proxy.kv_events.index.PromptKeys`, computed once per request and shared by both legs)."""

    text: str
    prompt_tokens: int
    token_ids: Sequence[int] | None = None
    prompt_keys: Any = None


class Policy(ABC):
    """Chooses an (instance, dp_rank) among the candidates of one pool."""

    uses_text = False  # whether choose() looks at RouteContext.text
    uses_token_ids = False  # whether choose() wants RouteContext.token_ids (the relay then tokenizes the prompt)

    @abstractmethod
    def choose(self, candidates: list[Instance], ctx: RouteContext) -> tuple[Instance, int]:
        """``candidates`` is non-empty and in stable address order. The same list object given again holds
        the same instances (the registry's :meth:`~atom_kv.proxy.fleet.registry.Registry.routable` list, or a
        caller's new list), so a policy may key what it derives from the candidates on the list's identity."""

    def charged_tokens(self, inst: Instance, rank: int, ctx: RouteContext, tokens: int) -> int:
        """The tokens of load a leg this policy just chose (``inst``, ``rank`` for ``ctx``) puts on its rank
        until it ends: by default ``tokens``, the prompt's; called once, right after :meth:`choose`."""
        return tokens

    def forget(self, inst: Instance) -> None:
        """``inst`` left the registry: drop whatever the policy remembers about it."""
