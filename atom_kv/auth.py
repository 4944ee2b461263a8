"""Proving knowledge of the shared ``auth_token`` without ever sending it.

Small pure helpers the whole package uses (no sockets, no threads):

- :func:`mac` / :func:`verify_mac`: HMAC-SHA256 keyed with the token over
  ``purpose + b"\\0" + payload``. The ``purpose`` label (for example
  :data:`PURPOSE_REGISTER`) binds a MAC to one kind of message, so a MAC
  computed for one protocol can never be replayed into another.
- :func:`new_nonce`: 16 random bytes, hex.
- :func:`canonical`: the bytes a map-shaped message is signed over (msgpack,
  keys sorted, without ``mac``), so keys added by newer senders still verify.
- :func:`sign_fields` / :func:`verify_fields`: the ``ts``/``nonce``/``mac``
  scheme for map-shaped messages such as the registration ping.
- :class:`ReplayWindow`: remembers nonces for ``window_s`` seconds, bounded
  in memory; a message whose timestamp is outside the window or whose nonce
  was already seen is refused.
- :func:`sign_struct` / :func:`verify_struct`: the same ``ts``/``nonce``/``mac``
  scheme for msgspec Structs with those three fields (the notices on a
  producer's handshake port: :class:`~atom_kv.wire.DoneReading`,
  :class:`~atom_kv.wire.Release`); :func:`struct_payload` is what they sign.
- :class:`ChallengeScheme`: the one challenge-response scheme, used by the
  handshake port (:data:`HANDSHAKE_CHALLENGE`, through
  :mod:`atom_kv.connector.handshake_auth`) and the data-path endpoints
  (:func:`data_path_challenge`, through :mod:`atom_kv.transfer._trust`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

import msgspec

__all__ = [
    "PURPOSE_BLOCKS",
    "PURPOSE_BLOCKS_ANSWER",
    "PURPOSE_DONE",
    "PURPOSE_DONE_ACK",
    "PURPOSE_HANDSHAKE_CLIENT",
    "PURPOSE_HANDSHAKE_REPLY",
    "PURPOSE_HANDSHAKE_SERVER",
    "PURPOSE_ISSUED",
    "PURPOSE_PEER_PROOF",
    "PURPOSE_REGISTER",
    "PURPOSE_RELEASE",
    "HANDSHAKE_CHALLENGE",
    "AuthError",
    "ChallengeScheme",
    "ReplayWindow",
    "canonical",
    "data_path_challenge",
    "mac",
    "new_nonce",
    "same_mac",
    "sign_fields",
    "sign_struct",
    "struct_payload",
    "verify_fields",
    "verify_mac",
    "verify_struct",
]

PURPOSE_REGISTER = "atom-kv/register/v1"
"""Registration pings (engine rank 0 -> proxy discovery port)."""
PURPOSE_HANDSHAKE_SERVER = "atom-kv/handshake-server/v1"
"""A producer rank's proof in its handshake challenge (both nonces, its identity)."""
PURPOSE_HANDSHAKE_CLIENT = "atom-kv/handshake-client/v1"
"""A consumer rank's answer to the challenge (both nonces, the request it sent)."""
PURPOSE_HANDSHAKE_REPLY = "atom-kv/handshake-reply/v1"
"""The sealed handshake reply (both nonces, the reply's bytes)."""
PURPOSE_PEER_PROOF = "atom-kv/peer-proof/v1"
"""A producer rank proving the token before it is sent signed notices."""
PURPOSE_DONE = "atom-kv/done/v1"
"""Done-reading notices (consumer rank -> producer rank)."""
PURPOSE_DONE_ACK = "atom-kv/done-ack/v1"
"""Done-reading confirmations, bound to the notice's nonce."""
PURPOSE_RELEASE = "atom-kv/release/v1"
"""Releases (decode engine or proxy -> every producer rank of a transfer)."""
PURPOSE_ISSUED = "atom-kv/issued/v1"
"""A producer scheduler's issued transfers (-> its own ranks)."""
PURPOSE_BLOCKS = "atom-kv/blocks-query/v1"
"""A consumer rank asking a producer rank for a transfer's block ids (the rendezvous)."""
PURPOSE_BLOCKS_ANSWER = "atom-kv/blocks-answer/v1"
"""The producer rank's answer, bound to the query's nonce."""

NONCE_BYTES = 16

_sorted_encoder = msgspec.msgpack.Encoder(order="sorted")

S = TypeVar("S", bound=msgspec.Struct)


class AuthError(Exception):
    """A message failed authentication. ``reason`` is a short label for counters:
    ``"auth"`` (missing or wrong MAC), ``"stale"`` (timestamp outside the
    window) or ``"replay"`` (nonce already seen, or no room to remember it)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _key(token: str | bytes) -> bytes:
    return token.encode("utf-8") if isinstance(token, str) else token


def mac(token: str | bytes, purpose: str, payload: bytes) -> str:
    """Hex HMAC-SHA256 of ``purpose + b"\\0" + payload`` keyed with ``token``."""
    return hmac.new(_key(token), purpose.encode("ascii") + b"\0" + payload, hashlib.sha256).hexdigest()


def verify_mac(token: str | bytes, purpose: str, payload: bytes, mac_hex: object) -> bool:
    """Constant-time check of a hex MAC; False for anything that is not a string."""
    return same_mac(mac(token, purpose, payload), mac_hex)


def same_mac(expected: str, given: object) -> bool:
    """Constant-time comparison of the MAC we computed with one a peer sent: False for
    anything that is not a string, non-ASCII text included (``hmac.compare_digest``
    raises ``TypeError`` on non-ASCII ``str``)."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8", "surrogatepass"))


def new_nonce() -> str:
    """16 random bytes, hex (32 characters)."""
    return os.urandom(NONCE_BYTES).hex()


def canonical(fields: Mapping[str, Any]) -> bytes:
    """msgpack of ``fields`` without ``mac``, keys sorted (nested maps too)."""
    return _sorted_encoder.encode({k: v for k, v in fields.items() if k != "mac"})


def sign_fields(
    token: str | bytes, purpose: str, fields: Mapping[str, Any], *, now: float | None = None,
    nonce: str | None = None,
) -> dict[str, Any]:
    """A copy of ``fields`` with ``ts`` (unix seconds), ``nonce`` and ``mac`` set."""
    signed = dict(fields)
    signed.pop("mac", None)
    signed["ts"] = float(time.time() if now is None else now)
    signed["nonce"] = new_nonce() if nonce is None else nonce
    signed["mac"] = mac(token, purpose, canonical(signed))
    return signed


class ReplayWindow:
    """Nonces seen in the last ``window_s`` seconds (at most ``max_entries``).

    Owns the memory of which signed messages were already accepted. Only
    messages whose MAC verified are recorded, so filling it takes the token;
    when it is full of unexpired nonces, new messages are refused (never
    forgotten early, which would re-open the replay).
    """

    def __init__(self, window_s: float = 30.0, max_entries: int = 65536) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> local time first seen

    def __len__(self) -> int:
        return len(self._seen)

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen:
            nonce, at = next(iter(seen.items()))
            if now - at <= 2 * self.window_s:  # a ts may be up to window_s in the future
                break
            seen.popitem(last=False)

    def admit(self, nonce: object, ts: object, now: float | None = None) -> None:
        """Record ``nonce``; raise :class:`AuthError` if ``ts`` is outside the window,
        the nonce was seen, or there is no room."""
        now = time.time() if now is None else now
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or abs(now - ts) > self.window_s:
            raise AuthError("stale", f"timestamp {ts!r} is not within {self.window_s:g}s of now ({now:.0f})")
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
            raise AuthError("auth", "missing or malformed nonce")
        self._expire(now)
        if nonce in self._seen:
            raise AuthError("replay", f"nonce {nonce[:16]}... was already used")
        if len(self._seen) >= self.max_entries:
            raise AuthError("replay", f"replay window full ({self.max_entries} nonces in {self.window_s:g}s)")
        self._seen[nonce] = now


def struct_payload(msg: msgspec.Struct, **extra: Any) -> bytes:
    """What a Struct's ``mac`` covers: :func:`canonical` of its fields (plus ``extra``)."""
    fields = msgspec.structs.asdict(msg)
    fields.update(extra)
    return canonical(fields)


def sign_struct(token: str | bytes, purpose: str, msg: S, *, now: float | None = None) -> S:
    """A copy of ``msg`` (a Struct with ``ts``, ``nonce`` and ``mac`` fields) with
    a fresh timestamp and nonce, signed."""
    fresh = msgspec.structs.replace(msg, ts=float(time.time() if now is None else now), nonce=new_nonce(), mac=None)
    return msgspec.structs.replace(fresh, mac=mac(token, purpose, struct_payload(fresh)))


def verify_struct(
    token: str | bytes, purpose: str, msg: msgspec.Struct, replay: ReplayWindow, *, now: float | None = None,
) -> None:
    """Check a Struct signed by :func:`sign_struct`; raise :class:`AuthError` if it
    fails. The MAC is checked first, so only proven messages use up the replay window."""
    given = getattr(msg, "mac", None)
    if not given:
        raise AuthError("auth", "missing mac")
    if not verify_mac(token, purpose, struct_payload(msg), given):
        raise AuthError("auth", "wrong mac")
    replay.admit(getattr(msg, "nonce", None), getattr(msg, "ts", None), now)


def verify_fields(
    token: str | bytes, purpose: str, fields: Mapping[str, Any], replay: ReplayWindow,
    *, now: float | None = None,
) -> None:
    """Check a map signed by :func:`sign_fields`; raise :class:`AuthError` if it fails.

    The MAC is checked first, so the replay window only ever holds nonces of
    messages that proved knowledge of the token."""
    if "mac" not in fields:
        raise AuthError("auth", "missing mac")
    if not verify_mac(token, purpose, canonical(fields), fields["mac"]):
        raise AuthError("auth", "wrong mac")
    replay.admit(fields.get("nonce"), fields.get("ts"), now)


# ---------------------------------------------------------------------------
# the challenge-response scheme
# ---------------------------------------------------------------------------
#: How a proof's payload is framed: ``(role, first_nonce, second_nonce, context) -> bytes``.
Framing = Callable[[str, str, str, Mapping[str, Any]], bytes]


def nonce_map_framing(role: str, first: str, second: str, context: Mapping[str, Any]) -> bytes:
    """The handshake port's framing: :func:`canonical` of ``{"c": first, "p": second, **context}``
    (the role is in the purpose label, one per role)."""
    return canonical({"c": first, "p": second, **context})


def role_joined_framing(role: str, first: str, second: str, context: Mapping[str, Any]) -> bytes:
    """The data path's framing: ``role | first | second`` joined by NUL bytes (one purpose label for
    both roles, so the role is in the payload; no context)."""
    return b"\0".join((role.encode("ascii"), first.encode("ascii", "replace"), second.encode("ascii", "replace")))


@dataclass(frozen=True)
class ChallengeScheme:
    """One mutual challenge-response: each side proves it knows the token with a :func:`mac` over both
    sides' fresh nonces (``first`` is the nonce of the side that spoke first), its role and what the proof
    covers (``context``). ``purposes`` names each role's purpose label; ``framing`` lays out the payload.
    A proof never verifies without both nonces, and never for another role or purpose.

    The two endpoint kinds frame their payloads differently on the wire (peers of older releases check
    those bytes, pinned by ``tests/test_challenge_vectors.py``); everything else is this one code."""

    purposes: Mapping[str, str]
    framing: Framing

    def prove(self, token: str | bytes, role: str, first: str, second: str, **context: Any) -> str:
        """The proof ``role`` sends over the nonces ``first`` and ``second`` and ``context``."""
        return mac(token, self.purposes[role], self.framing(role, first, second, context))

    def verify(self, token: str | bytes, role: str, first: str, second: str, proof: object, **context: Any) -> bool:
        """Constant-time: does ``proof`` show that ``role`` knows ``token``? False without both nonces."""
        if not first or not second:
            return False
        return same_mac(self.prove(token, role, first, second, **context), proof)


#: The handshake port's challenge (consumer nonce first): the producer's ``server`` proof in its challenge,
#: the consumer's ``client`` answer, and the ``reply`` seal (:mod:`atom_kv.connector.handshake_auth`).
HANDSHAKE_CHALLENGE = ChallengeScheme(
    {"server": PURPOSE_HANDSHAKE_SERVER, "client": PURPOSE_HANDSHAKE_CLIENT, "reply": PURPOSE_HANDSHAKE_REPLY},
    nonce_map_framing,
)


def data_path_challenge(purpose: str) -> ChallengeScheme:
    """A data-path endpoint's challenge (server nonce first): ``reader`` and ``server`` proofs under the
    endpoint kind's ``purpose`` (:mod:`atom_kv.transfer._trust`)."""
    return ChallengeScheme({"reader": purpose, "server": purpose}, role_joined_framing)
