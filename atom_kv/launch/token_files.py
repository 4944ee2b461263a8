"""Token files as the docs have operators make them: one line, readable by their owner only (mode 0600),
so a harness passes the cluster secret by path and no process list shows it."""

from __future__ import annotations

import os

__all__ = ["write_token_file"]


def write_token_file(path: str, token: str) -> str:
    """Write ``token`` and a newline to ``path`` with mode 0600 (replacing what is there); return ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, (token + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    return path
