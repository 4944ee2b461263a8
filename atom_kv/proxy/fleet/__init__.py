"""The engines the proxy knows: registration pings, static engines, the registry, health probes and circuit breakers."""
