"""Benchmarks, where every figure we quote comes from: ``python -m atom_kv.bench {transfer,connector,proxy,e2e,vllm} ...``.

One module per suite; ``client.py`` is the streaming client that ``e2e --breakdown`` and ``vllm`` share.
"""
