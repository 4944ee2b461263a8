"""KV cache events of the reference engine, on vLLM's wire: the event Structs
(:mod:`.events`), ``--kv-events-config`` (:mod:`.config`) and the ZeroMQ
publisher with replay (:mod:`.publisher`). See docs/kv-events.md."""
