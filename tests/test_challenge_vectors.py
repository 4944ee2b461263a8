"""The challenge-response proofs on the wire, pinned: known vectors computed with the code before the two
schemes (handshake port, data-path endpoints) shared one implementation. Peers of older releases check
these bytes, so any change here breaks interoperation."""

from __future__ import annotations

import pytest

from atom_kv.connector import handshake_auth
from atom_kv.transfer import _trust
from atom_kv.transfer._trust import PURPOSE_CMA_GRANT, PURPOSE_GPU_IPC_GRANT, PURPOSE_TCP_READ

TOKEN = "vector-token"
C, P = "c" * 32, "p" * 32          # the consumer's and the producer's nonces on the handshake port
SERVER, READER = "s" * 32, "r" * 32  # the server's and the reader's nonces on a data-path endpoint


def test_handshake_port_proofs_are_todays_bytes():
    assert handshake_auth.server_proof(TOKEN, C, P, "P1", 3) == (
        "c5b209bfe06ade8147935f3012e8de15e1bb01dd8b8cb18592a57cd642a00183")
    assert handshake_auth.client_proof(TOKEN, C, P, b"request-bytes") == (
        "d65252f4c21da702e2116bd76141d7ca9552773cf65459736a67d7373ca1fd46")
    assert handshake_auth.reply_mac(TOKEN, C, P, b"reply-bytes") == (
        "194f0639d6e865f7eca671c9d64ff9fb38f0152edb13c0b8539f7e901e6e78bf")
    assert handshake_auth.peer_proof(TOKEN, "n" * 32, "P1", 3) == (
        "89f94ba80a6c95b019482291766aa3e9ea9737f50515fc7d8f2ab9da4eeca1b1")


@pytest.mark.parametrize("purpose, server, reader", [
    (PURPOSE_TCP_READ, "5926512e4f54a03ad9b19b246fb7d42adc3480d4cb2d2928e99fbacc977e7390",
     "9b380c1163f62316f111430eccce0977ce0538c41b7f751c7ffed1411a73b590"),
    (PURPOSE_CMA_GRANT, "a54932c2dfaefa9d83f9e0faef7c80ee8d6ead81790dc813c81aa9f22161f51c",
     "388bf97fce3ffd9e73203cb860ac3fa4555171def7b3825a69551c015907dcf7"),
    (PURPOSE_GPU_IPC_GRANT, "49cd76d2bfec11150030544544385d0334c930e48343bb3d855c467398646deb",
     "7676f33f615165db2a4a0c1148346367ee11c4409d28fe88f06015a340dbb9e8"),
])
def test_data_path_proofs_are_todays_bytes(purpose: str, server: str, reader: str):
    token = TOKEN.encode()
    assert _trust.server_proof(token, purpose, SERVER, READER) == server
    assert _trust.reader_proof_ok(token, purpose, SERVER, READER, reader)
    assert not _trust.reader_proof_ok(token, purpose, SERVER, READER, server)  # the roles differ
    assert not _trust.reader_proof_ok(token, purpose, SERVER, "", reader)  # a proof needs the reader's nonce


def test_one_scheme_serves_both_endpoint_kinds():
    from atom_kv.auth import HANDSHAKE_CHALLENGE, data_path_challenge
    # the handshake port's proofs are the shared scheme's, under its roles
    assert HANDSHAKE_CHALLENGE.prove(TOKEN, "server", C, P, engine_id="P1", tp_rank=3) == (
        handshake_auth.server_proof(TOKEN, C, P, "P1", 3))
    assert HANDSHAKE_CHALLENGE.verify(TOKEN, "server", C, P, handshake_auth.server_proof(TOKEN, C, P, "P1", 3),
                                      engine_id="P1", tp_rank=3)
    assert not HANDSHAKE_CHALLENGE.verify(TOKEN, "server", C, P, handshake_auth.server_proof(TOKEN, C, P, "P1", 3),
                                          engine_id="P1", tp_rank=4)  # bound to what it covers
    scheme = data_path_challenge(PURPOSE_TCP_READ)
    proof = scheme.prove(TOKEN, "reader", SERVER, READER)
    assert scheme.verify(TOKEN.encode(), "reader", SERVER, READER, proof)
    assert not scheme.verify(TOKEN, "server", SERVER, READER, proof)  # another role
    assert not data_path_challenge(PURPOSE_CMA_GRANT).verify(TOKEN, "reader", SERVER, READER, proof)  # another purpose
    assert not scheme.verify(TOKEN, "reader", "", READER, scheme.prove(TOKEN, "reader", "", READER))  # both nonces
    assert not scheme.verify("other-token", "reader", SERVER, READER, proof)
