"""Learning a transfer's block ids from the producer (the rendezvous).

A decode leg dispatched while its prefill still computes carries the
producer's address and the ``transfer_id`` but no block ids
(``remote_blocks_pending``). Each consumer rank asks one producer rank with a
signed :class:`~atom_kv.wire.BlocksQuery`; the rank answers with a
:class:`~atom_kv.wire.BlocksAnswer` (signed over the query's nonce) as soon as
its scheduler lent the blocks, or says why not (released: the prefill failed
or the decode gave up; not issued within the wait).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Union

import msgspec
import zmq

from atom_kv import wire
from atom_kv.auth import PURPOSE_BLOCKS, sign_struct
from atom_kv.connector.confirm import DealerCache
from atom_kv.connector.handshake_auth import verify_answer
from atom_kv.connector.reasons import BlocksFailure as F
from atom_kv.connector.reasons import NoBlocks
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import HANDSHAKE_PROTOCOL_VERSION, BlocksAnswer, BlocksQuery, WireError

__all__ = ["BlocksClient"]

logger = logging.getLogger(__name__)

#: Largest answer accepted: a million block ids, msgpack-encoded
MAX_ANSWER_BYTES = 8 << 20
#: How often a waiting query looks at its stop and cancel events
_POLL_S = 0.05


class BlocksClient:
    """Owns one thread's DEALER sockets (one per producer rank, LRU-bounded)
    for blocks queries. Only the thread that uses it may call it."""

    def __init__(self, ctx: zmq.Context, *, stats: TransferStats, auth_token: Optional[str] = None,
                 max_sockets: int = 64) -> None:
        self._stats = stats
        self._token = auth_token
        # RCVHWM: what a peer (any host a client named) can make this socket queue
        self._socks = DealerCache(ctx, max_sockets,
                                  {zmq.MAXMSGSIZE: MAX_ANSWER_BYTES, zmq.SNDHWM: 1024, zmq.RCVHWM: 16})

    def blocks(self, host: str, port: int, msg: BlocksQuery, timeout_s: float, stop: threading.Event,
               cancelled: threading.Event, pp_size: int = 1) -> Union[BlocksAnswer, NoBlocks]:
        """Ask the producer rank at ``host:port`` for ``msg.transfer_id``'s block
        ids, waiting up to ``timeout_s`` (the producer holds the question as long,
        capped by its own ``prefill_wait_timeout_s``). Returns the answer (found,
        with block ids, and the prefill's first token when its engine gave it), or
        :class:`~atom_kv.connector.reasons.NoBlocks`: why there are none (also when the producer has other pipeline
        stages than ``pp_size``: the load would miss layers). An answer that is not
        ``found`` but ``coming`` (the producer's scheduler has the request queued or
        computing) is returned as it is: the caller decides whether to ask again."""
        msg = msgspec.structs.replace(msg, wait_ms=max(0, min(wire.MAX_BLOCKS_WAIT_MS, int(timeout_s * 1000))))
        if self._token is not None:
            msg = sign_struct(self._token, PURPOSE_BLOCKS, msg)
        where = f"producer rank at {host}:{port}"
        try:
            sock = self._socks.get(host, port)
            sock.send(wire.encode(msg), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:
            self._socks.drop(host, port)
            return NoBlocks(F.UNREACHABLE, f"cannot ask the {where} for the blocks of transfer {msg.transfer_id}: {exc}")
        deadline = time.monotonic() + timeout_s + 1.0  # the producer answers at timeout_s; a second for the wire
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._socks.drop(host, port)  # a late answer must not linger in a reused socket
                return NoBlocks(F.TIMEOUT, f"the {where} named no blocks for transfer {msg.transfer_id} within {timeout_s:g} s")
            if stop.is_set():
                return NoBlocks(F.CLOSING, "connector closing")
            if cancelled.is_set():
                self._socks.drop(host, port)
                return NoBlocks(F.CANCELLED, "the request ended while waiting for the prefill")
            if not sock.poll(int(min(left, _POLL_S) * 1000), zmq.POLLIN):
                continue
            try:
                data = sock.recv_multipart(zmq.NOBLOCK)[-1]
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                self._socks.drop(host, port)
                return NoBlocks(F.UNREACHABLE, f"no blocks from the {where}: {exc}")
            verdict = self._judge(data, msg, where, host, port, pp_size)
            if verdict is not None:
                return verdict

    def _judge(self, data: bytes, msg: BlocksQuery, where: str, host: str, port: int,
               pp_size: int) -> Union[BlocksAnswer, NoBlocks, None]:
        """The answer with block ids, the reason there are none, or None for an answer to an older question."""
        try:
            answer = wire.decode(data, BlocksAnswer)
        except (WireError, RecursionError) as exc:
            self._stats.add(bad_messages=1)
            self._socks.drop(host, port)
            v = wire.peek_version(data)
            if v is not None and v != HANDSHAKE_PROTOCOL_VERSION:
                return NoBlocks(F.VERSION, f"the {where} speaks handshake protocol version {v}, "
                                           f"this engine {HANDSHAKE_PROTOCOL_VERSION}")
            logger.warning("blocks answer from %s for transfer %s: %s", where, msg.transfer_id, exc)
            return NoBlocks(F.BAD_ANSWER, f"bad blocks answer from the {where}: {exc}")
        if self._token is not None and not verify_answer(self._token, answer, msg.nonce or ""):
            logger.debug("ignoring a blocks answer for transfer %s from %s that does not answer this query",
                         answer.transfer_id, where)
            return None
        if answer.transfer_id != msg.transfer_id:
            return None
        if not answer.found and answer.coming:
            return answer  # still queued or computing there: the caller asks again
        if not answer.found:
            return NoBlocks(F.REFUSED, answer.reason or f"the {where} holds no blocks for transfer {msg.transfer_id}")
        if not answer.block_ids:
            return NoBlocks(F.EMPTY, f"the {where} named an empty block list for transfer {msg.transfer_id}")
        if answer.pp_size != pp_size:
            return NoBlocks(F.PIPELINE, f"the {where} has {answer.pp_size} pipeline stage(s), the decode leg named "
                                        f"{pp_size}: concurrent dispatch needs the stages in the decode leg "
                                        "(remote_pp_size)")
        return answer

    def close(self) -> None:
        self._socks.close()
