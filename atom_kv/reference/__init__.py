"""A small but real paged-KV inference engine that uses ``atom_kv.engine_hooks``.

Run it with ``python -m atom_kv.reference --host H --port P``. It owns a tiny
Llama-style model with deterministic random weights, a byte-level tokenizer,
a paged KV cache, a continuous-batching scheduler, tensor-parallel worker
processes and an OpenAI-compatible HTTP server.
"""
