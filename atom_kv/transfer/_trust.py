"""Challenge-response on the data-path endpoints (the tcp read server and the
cma grant endpoint): both sides prove they know ``auth_token``; it never
travels.

1. The server speaks first with a fresh ``server_nonce`` (empty when it has no
   token: then there is no challenge step at all).
2. The reader answers with its own fresh ``reader_nonce`` and
   ``mac(token, purpose, "reader" | server_nonce | reader_nonce)``.
3. The server checks it and answers with
   ``mac(token, purpose, "server" | server_nonce | reader_nonce)``; the reader
   checks that before sending anything further (mutual authentication).

Each proof covers both nonces (no replay onto another connection) and names
its role (a server that lacks the token cannot reflect the reader's proof
back). ``purpose`` binds a proof to one endpoint kind. The scheme is the
package's one challenge-response, :func:`atom_kv.auth.data_path_challenge`.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.auth import data_path_challenge, new_nonce
from atom_kv.transfer.base import TransferError

__all__ = [
    "PURPOSE_CMA_GRANT",
    "PURPOSE_GPU_IPC_GRANT",
    "PURPOSE_TCP_READ",
    "RateLimitedLog",
    "ReaderProof",
    "new_nonce",
    "peek_version",
    "reader_proof_ok",
    "server_proof",
    "version_refusal",
]

PURPOSE_TCP_READ = "atom-kv/tcp-read/v1"
PURPOSE_CMA_GRANT = "atom-kv/cma-grant/v1"
PURPOSE_GPU_IPC_GRANT = "atom-kv/gpu-ipc-grant/v1"

AUTH_HINT = "set the same auth_token on both engines"


def reader_proof_ok(token: bytes, purpose: str, server_nonce: str, reader_nonce: str, proof: str) -> bool:
    """Server side: does ``proof`` show the reader knows ``token``? An empty
    reader nonce never passes (a proof must cover a nonce of each side)."""
    return data_path_challenge(purpose).verify(token, "reader", server_nonce, reader_nonce, proof)


def server_proof(token: bytes, purpose: str, server_nonce: str, reader_nonce: str) -> str:
    """Server side: the proof the server sends back to an accepted reader."""
    return data_path_challenge(purpose).prove(token, "server", server_nonce, reader_nonce)


class ReaderProof:
    """The reader's half of one handshake: built from the server's nonce,
    carries what the reader sends (``nonce``, ``proof``) and checks the
    server's answer. ``label`` ("tcp", "cma") and ``where`` word the errors."""

    def __init__(self, token: Optional[str], purpose: str, server_nonce: str, label: str, where: str) -> None:
        self._token = token.encode("utf-8") if token else None
        self._scheme = data_path_challenge(purpose)
        self._server_nonce = server_nonce
        self._label = label
        self._where = where
        self.nonce = ""
        self.proof = ""
        if self._token is None:
            return  # an unchallenged reader sends no proof; a challenging server refuses it and says why
        if not server_nonce:
            raise TransferError(
                f"{label}: peer {where} does not authenticate (it has no auth_token) but this engine has one; "
                f"{AUTH_HINT}"
            )
        self.nonce = new_nonce()
        self.proof = self._scheme.prove(self._token, "reader", server_nonce, self.nonce)

    def check_server(self, proof: str) -> None:
        """Raise :class:`TransferError` unless the server proved it knows the token."""
        if self._token is None:
            return
        if not self._scheme.verify(self._token, "server", self._server_nonce, self.nonce, proof):
            raise TransferError(
                f"{self._label}: peer {self._where} could not prove it knows the auth_token; refusing it "
                f"({AUTH_HINT})"
            )


def version_refusal(label: str, peer_role: str, theirs: object, ours: int) -> str:
    """The one-line refusal for a protocol version mismatch, naming both."""
    return (
        f"{label}: protocol version mismatch: the {peer_role} speaks v{theirs}, this side speaks v{ours}; "
        "run the same atom-kv version on both engines"
    )


def peek_version(payload: bytes | bytearray) -> Optional[int]:
    """The ``v`` of a msgpack map that did not decode as the expected message
    (so a newer peer's hello is refused naming both versions), else None."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    v = obj.get("v") if isinstance(obj, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None
