"""Old import path of :mod:`atom_kv.launch.ports` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.ports import free_ephemeral_window, free_plan_base, free_port, free_port_range

__all__ = ["free_ephemeral_window", "free_plan_base", "free_port", "free_port_range"]
