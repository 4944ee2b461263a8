"""Old import path of :mod:`atom_kv.launch.token_files` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.token_files import write_token_file

__all__ = ["write_token_file"]
