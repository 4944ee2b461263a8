"""A process that serves one producer rank's handshake port (with a token) and nothing else, for tests
that measure what strangers make it hold: ``python -m tests.connector.handshake_proc PORT``; it prints
``ready`` when it listens and stops when its stdin closes. A ``trim`` line on its stdin hands the memory
the allocator keeps free back to the system (``malloc_trim``) and answers ``trimmed``: what stays is held."""

from __future__ import annotations

import ctypes
import gc
import sys

import zmq

from atom_kv.connector.handshake import BasePortHandler, HandshakeServer
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import HandshakeReply

TOKEN = "handshake-proc-token-7c1d"


class _Port(BasePortHandler):
    """Answers every proven handshake with an empty reply; drops the notices."""

    def identity(self) -> tuple[str, int]:
        return "P", 0

    def answer_handshake(self, request):
        return HandshakeReply(ok=True, engine_id="P")

    def on_done(self, msg, respond) -> None:
        pass

    def on_release(self, msg) -> None:
        pass


def main(port: int) -> None:
    ctx = zmq.Context()
    server = HandshakeServer(ctx, _Port(), bind_host="127.0.0.1", port=port, auth_token=TOKEN,
                             stats=TransferStats("P"), name="atom-kv-hs-server-test").start()
    print("ready", flush=True)
    try:
        for line in sys.stdin:  # until the test closes our stdin
            if line.strip() == "trim":
                gc.collect()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                print("trimmed", flush=True)
    finally:
        server.close()
        ctx.term()


if __name__ == "__main__":
    main(int(sys.argv[1]))
