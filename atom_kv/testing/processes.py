"""Old import path of :mod:`atom_kv.launch.processes` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.processes import ManagedProcess, REPO_ROOT, interrupts_held

__all__ = ["ManagedProcess", "interrupts_held", "REPO_ROOT"]
