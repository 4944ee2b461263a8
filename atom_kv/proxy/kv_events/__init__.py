"""The proxy's view of what the engines cache, from their KV cache events (vLLM's wire, ATOM's variant).

- :mod:`.wire`: the event Structs and the decoder of a received message;
- :mod:`.keys`: chain keys of token blocks (what the index is keyed on);
- :mod:`.table`: one worker's engine hash -> chain key map, compact;
- :mod:`.index`: the index (longest prefix per worker, predictions of recent routing decisions);
- :mod:`.predict`: those predictions;
- :mod:`.subscriber`: the thread that follows every publisher (sequence numbers, replay, restarts);
- :mod:`.endpoints`: publisher addresses and the per-DP-rank port rule;
- :mod:`.stats`: the counters and their ``/metrics`` collector;
- :mod:`.service`: :class:`KvEvents`, the one object the proxy holds.
"""

from atom_kv.proxy.kv_events.service import KvEvents, KvEventsConfig

__all__ = ["KvEvents", "KvEventsConfig"]
