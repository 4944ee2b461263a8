"""Test and bench scaffolding (fake engines, a raw-socket engine, KV event readers, vLLM servers, simulated
hosts in network namespaces); never used by the product and not in the wheel: it runs from a checkout. The
launcher the demo needs lives in ``atom_kv.launch``; the modules here of the same names re-export it."""
