"""Old import path of :mod:`atom_kv.proxy.http.upstream` (named in the docs), kept working."""

from atom_kv.proxy.http.upstream import (
    AnswerLimits, BodyConsumer, UpstreamConnectionError, UpstreamConnectTimeout, UpstreamError, UpstreamPool,
    UpstreamProtocolError, UpstreamResponse, UpstreamTimeout, UpstreamTooLarge,
)

__all__ = [
    "UpstreamPool", "UpstreamResponse", "BodyConsumer", "UpstreamError", "UpstreamConnectTimeout",
    "UpstreamTimeout", "UpstreamConnectionError", "UpstreamProtocolError", "UpstreamTooLarge",
    "AnswerLimits",
]
