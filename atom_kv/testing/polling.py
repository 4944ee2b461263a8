"""Old import path of :mod:`atom_kv.launch.polling` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.polling import wait_until

__all__ = ["wait_until"]
