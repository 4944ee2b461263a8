"""The P/D demo (``python -m atom_kv.demo``) and the process helpers it shares
with the end-to-end tests, the e2e bench and the examples."""
