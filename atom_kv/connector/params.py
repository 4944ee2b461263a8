"""One request's ``kv_transfer_params``, parsed once where the scheduler first sees them.

:class:`RequestParams` is what the scheduler's later steps take instead of the
client's dict: the keys that validated (a :class:`~atom_kv.wire.KVTransferParams`),
the one-line errors of those that did not, and what the steps ask of them: the
producer ranks to release (:attr:`RequestParams.release_spec`, usable even when
another key refused the params), the transfer id a producer may adopt, and the
key a load lacks (``wire.missing_for_load()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import msgspec

from atom_kv.config import FieldError
from atom_kv.connector.release import ReleaseSpec
from atom_kv.wire import KVTransferParams, adoptable_transfer_id

__all__ = ["RequestParams", "ParamsIn"]

#: the keys naming the producer ranks to release, by what each falls back to (ATOM's unprefixed keys):
#: the first one given decides, and a release needs it readable
_WHOM = (("remote_handshake_port", "remote_port"), ("remote_tp_size", "tp_size"), ("remote_dp_rank", "dp_rank"))


class RequestParams(msgspec.Struct, frozen=True, kw_only=True):
    """Owns one request's parsed ``kv_transfer_params``: ``wire`` holds every key
    that validated (all of them when ``errors`` is empty), ``errors`` one line
    per key that did not, ``offered_transfer_id`` the ``transfer_id`` as sent
    (named in the log when a producer cannot adopt it)."""

    wire: KVTransferParams = msgspec.field(default_factory=KVTransferParams)
    errors: tuple[FieldError, ...] = ()
    offered_transfer_id: Any = None

    @classmethod
    def parse(cls, raw: Any) -> "RequestParams":
        """The params of a request as its engine passed them (any value; ``None`` means none), in one pass."""
        params, errors = KVTransferParams.parse(raw)
        offered = raw.get("transfer_id") if isinstance(raw, Mapping) else None
        return cls(wire=params, errors=tuple(errors), offered_transfer_id=offered)

    @classmethod
    def of(cls, value: "ParamsIn") -> "RequestParams":
        """``value`` itself when an engine parsed it already, else :meth:`parse` of it."""
        return value if isinstance(value, RequestParams) else cls.parse(value)

    @property
    def refusal(self) -> Optional[str]:
        """Why a decode engine ignores the params (the first bad key, in one line), or None."""
        return str(self.errors[0]) if self.errors else None

    @property
    def send_refusal(self) -> Optional[str]:
        """Why a prefill engine ignores the params, or None: an unusable ``transfer_id``
        never costs the request its remote decode (the producer mints one instead)."""
        return next((str(e) for e in self.errors if e.key != "transfer_id"), None)

    @property
    def adoptable_transfer_id(self) -> Optional[str]:
        """The offered ``transfer_id`` when a producer may use it as its own (a
        :data:`~atom_kv.wire.TransferId`), else None."""
        tid = self.wire.transfer_id
        return None if tid is None else adoptable_transfer_id(tid)

    @property
    def release_spec(self) -> Optional[ReleaseSpec]:
        """The producer ranks a decode request's params name, or None when they
        do not name a remote prefill (``do_remote_prefill``, ``transfer_id``,
        ``remote_host``, a handshake port), name more than
        :data:`~atom_kv.connector.release.MAX_RELEASE_RANKS` ranks or ports
        beyond 65535. Each key counts on its own, so params refused for another
        key still say whom to release; the pipeline and DP sizes only add ports,
        so when unreadable at least the first stage is released. (The scheduler
        sends to the first rank only of a producer its ranks never reached:
        :mod:`atom_kv.connector.known_producers`.)"""
        p = self.wire
        if not p.do_remote_prefill or self._unreadable_whom():
            return None
        port = p.producer_handshake_port
        if p.transfer_id is None or p.remote_host is None or port is None:
            return None
        return ReleaseSpec.bounded(p.transfer_id, p.remote_host, port, p.producer_tp_size, p.producer_dp_rank,
                                   p.remote_pp_size or 1, p.remote_dp_size or 1)

    def _unreadable_whom(self) -> bool:
        """True when the first given key of a :data:`_WHOM` group failed validation."""
        bad = {e.key for e in self.errors}
        for group in _WHOM:
            for key in group:
                if key in bad:
                    return True
                if getattr(self.wire, key) is not None:
                    break
        return False


#: what the scheduler's entry takes: the engine's raw ``kv_transfer_params`` (any value) or params it parsed
ParamsIn = Union[Mapping[str, Any], RequestParams, None]
