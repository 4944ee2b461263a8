"""Why the connector refused or failed something, as types next to the operator's words.

The words travel on the wire as they always have (a ``DoneAck.reason``, a
``BlocksAnswer.reason``, a load's error); code decides on these types, never on
the words. A producer rank refuses a confirmation for a :class:`Refusal` and
answers a blocks query without blocks for a :class:`QueryRefusal`; a consumer
rank's rendezvous ends without blocks for a :class:`BlocksFailure`, carried
with its text by :class:`NoBlocks`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["BlocksFailure", "NoBlocks", "QueryRefusal", "Refusal"]


class Refusal(enum.Enum):
    """Why a producer rank did not confirm a read (``DoneAck(valid=False)``); the value keys its log line."""

    NOT_READ = "not_read"      # the consumer said it did not read the blocks
    CROWDED = "crowded"        # too many confirmations wait for the transfer
    UNISSUED = "unissued"      # the rank never learnt the transfer (within the wait)
    RELEASED = "released"      # the blocks were released before the notice came
    BLOCKS = "blocks"          # the consumer read other blocks than the transfer's


class QueryRefusal(enum.Enum):
    """Why a producer rank answered a blocks query without blocks; the value keys its log line."""

    RELEASED = "released"           # the transfer was released or dropped
    SOURCE_FULL = "already_wait"    # the asking address holds its share of waiting queries
    FULL = "queries_wait"           # the table is full of queries from addresses holding no more
    CROWDED = "crowded"             # too many queries wait for the transfer
    UNISSUED = "not_issued"         # the rank did not learn the transfer within the wait


class BlocksFailure(enum.Enum):
    """Why a consumer rank's rendezvous ended without blocks to read."""

    UNREACHABLE = "unreachable"    # the question could not be sent, or the socket failed
    TIMEOUT = "timeout"            # no answer within the wait
    CLOSING = "closing"            # the connector is closing
    CANCELLED = "cancelled"        # the request ended while waiting
    BAD_ANSWER = "bad_answer"      # the answer did not decode
    VERSION = "version"            # the producer speaks another protocol version
    REFUSED = "refused"            # the producer answered that it holds no blocks (its words follow)
    EMPTY = "empty"                # the producer named an empty block list
    PIPELINE = "pipeline"          # the producer's pipeline stages are not the decode leg's
    TOO_FEW = "too_few"            # the producer holds fewer blocks than this engine needs
    STILL_COMING = "still_coming"  # the prefill was still queued after prefill_queue_timeout_s
    INTERNAL = "internal"          # a bug here: the text says which


@dataclass(frozen=True)
class NoBlocks:
    """A rendezvous that ended without blocks: the typed reason and the operator's words."""

    reason: BlocksFailure
    text: str

    def __str__(self) -> str:
        return self.text

