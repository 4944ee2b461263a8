"""A process that serves one producer rank's handshake port (with a token) and nothing else, for tests
that measure what strangers make it hold: ``python -m tests.connector.handshake_proc PORT``; it prints
``ready`` when it listens and stops when its stdin closes."""

from __future__ import annotations

import sys

import zmq

from atom_kv.connector.handshake import HandshakeServer
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import HandshakeReply

TOKEN = "handshake-proc-token-7c1d"


def main(port: int) -> None:
    ctx = zmq.Context()
    server = HandshakeServer(
        ctx, bind_host="127.0.0.1", port=port, auth_token=TOKEN, identity=lambda: ("P", 0),
        responder=lambda req: HandshakeReply(ok=True, engine_id="P"), on_done=lambda msg, respond: None,
        on_release=lambda msg: None, stats=TransferStats("P"), name="atom-kv-hs-server-test",
    )
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the test closes our stdin
    finally:
        server.close()
        ctx.term()


if __name__ == "__main__":
    main(int(sys.argv[1]))
