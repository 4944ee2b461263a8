"""Which ``atom`` the ATOM tests import: the fake (contract test) or ATOM itself (``ATOM_SRC``).

Both are the top-level package ``atom``, so one test session sees only one of
them: the contract test runs when ``ATOM_SRC`` is unset (``make test``), the
real-ATOM test when it is set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

FAKE_ATOM = Path(__file__).resolve().with_name("fake_atom")


def use_fake_atom() -> Optional[str]:
    """Put the fake ATOM on ``sys.path``; or the reason the contract test cannot run here."""
    if os.environ.get("ATOM_SRC"):
        return ("ATOM_SRC is set, so `atom` is ATOM itself in this session: "
                "tests/integrations/test_atom_real.py runs the same scenarios against it")
    if str(FAKE_ATOM) not in sys.path:
        sys.path.insert(0, str(FAKE_ATOM))
    return None


def use_real_atom() -> Optional[str]:
    """Put ``$ATOM_SRC`` on ``sys.path`` and import ATOM's scheduler; or the reason to skip.

    Fails (rather than skips) when ``ATOM_SRC`` is set but ATOM does not import:
    the run asked for ATOM and would otherwise pass without testing it.
    """
    src = os.environ.get("ATOM_SRC")
    if not src:
        return ("ATOM_SRC is not set: point it at a ROCm/ATOM checkout and run in a venv with ATOM's "
                "dependencies (docs/atom.md, 'Testing against ATOM')")
    if src not in sys.path:
        sys.path.insert(0, src)
    try:
        import atom.model_engine.scheduler  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"ATOM_SRC={src}: ATOM's scheduler does not import here ({exc}); use a venv with "
                           "ATOM's dependencies (docs/atom.md, 'Testing against ATOM')") from exc
    return None


def atom_commit(src: str) -> str:
    """The commit of an ATOM checkout, read from its .git (no git binary needed), or 'unknown'."""
    git = Path(src) / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            path = git / ref
            if path.exists():
                return path.read_text().strip()
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        return head
    except OSError:
        return "unknown"
