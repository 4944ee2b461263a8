"""Old import path of :mod:`atom_kv.proxy.observability.spans` (named in the docs), kept working."""

from atom_kv.proxy.observability.spans import SPANS, RequestSpans

__all__ = ["RequestSpans", "SPANS"]
