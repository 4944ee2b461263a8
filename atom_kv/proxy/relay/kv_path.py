"""Whether a request whose pair failed on the decode-to-prefill KV path is planned again.

A decode engine that answers ``X-KV-Transfer-Failure: prefill`` could not load the
prefill's KV: it could not connect to the prefill's handshake or transfer port (a
firewall between the two hosts, a wrong advertised address), the handshake was
refused or timed out, a read failed, or the prefill no longer held the blocks. The
same pair again would spend a fresh prefill to fail the same way, so the relay plans
another attempt only when another pair exists: a prefill or a decode instance this
request has not failed on yet, among those the router picks from (the live instances
whose circuit lets requests through, or every live one when no circuit does, as
:meth:`~atom_kv.proxy.relay.relay.Relay._pick` chooses). The failed pair's two
instances are both excluded, so the next pair differs in at least one of them.
"""

from __future__ import annotations

import time

from atom_kv.proxy.fleet.registry import Registry, Role

__all__ = ["KV_PATH_FAILED", "another_pair"]

#: how the client's error names the hop that failed (the proxy's own hops name the engine they reach)
KV_PATH_FAILED = "decode-to-prefill KV path failed: "


def another_pair(registry: Registry, exclude: dict[str, set[tuple[str, str]]], now: float | None = None) -> bool:
    """Whether a prefill or a decode instance outside ``exclude`` (keys by role) is left to pair with."""
    now = time.monotonic() if now is None else now
    return any(_untried(registry, role, exclude[role], now) for role in ("P", "D"))


def _untried(registry: Registry, role: Role, excluded: set[tuple[str, str]], now: float) -> bool:
    live = registry.live(role, now)
    candidates = [i for i in live if i.breaker.allows(now)] or live
    return any(i.key not in excluded for i in candidates)
