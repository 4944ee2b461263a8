"""The P/D demo (``python -m atom_kv.demo``): a scripted end-to-end run on 127.0.0.1 that
launches its processes with the cluster launcher in ``atom_kv.launch``."""
