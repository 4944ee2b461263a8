"""Benchmarks: ``python -m atom_kv.bench {transfer,connector,proxy,e2e} ...``."""
