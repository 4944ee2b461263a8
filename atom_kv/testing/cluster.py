"""Old import path of :mod:`atom_kv.launch.cluster` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.cluster import AUTO_TOKEN, Cluster, EngineSpec

__all__ = ["EngineSpec", "Cluster", "AUTO_TOKEN"]
