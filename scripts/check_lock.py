"""Check that this Python's environment holds exactly the lock's versions.

``make test`` runs it before the suite: CI must test what the lock says, not
whatever a stale or hand-touched venv holds. Names are compared normalised
(PEP 503), versions as written, local labels included (``torch==2.13.0+cpu``).
pip, setuptools and wheel are left out: ``python -m venv`` brings its own, and
``pip freeze`` does not list them either. Exit 0 when they agree, else 1 with one
line per difference.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

_SKIP = {"pip", "setuptools", "wheel", "atom-kv"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)(?:\s*;.*)?", line)
            if m is None:
                raise SystemExit(f"check_lock: {path}: not a name==version line: {line!r}")
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    return {_norm(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def differences(lock: dict[str, str], have: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(lock) | set(have)):
        if name in _SKIP:
            continue
        want, got = lock.get(name), have.get(name)
        if want is None:
            out.append(f"{name}=={got} is installed but not in the lock")
        elif got is None:
            out.append(f"{name}=={want} is in the lock but not installed")
        elif want != got:
            out.append(f"{name}: the lock says {want}, {got} is installed")
    return out


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "requirements-lock.txt"
    diff = differences(read_lock(path), installed())
    for line in diff:
        print(f"check_lock: {line}", file=sys.stderr)
    if diff:
        print(f"check_lock: this environment is not {path}; rebuild it (make clean venv)", file=sys.stderr)
        return 1
    print(f"check_lock: {len(read_lock(path))} packages, exactly as {path} says")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
