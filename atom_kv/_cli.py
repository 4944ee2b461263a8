"""The argument parser of every atom-kv command line: a refused argument is one line, not the usage block.

argparse prints the whole usage (over fifty lines for the proxy) before the
line that says what is wrong. :class:`OneLineParser` prints only that line,
pointing at ``--help``, and exits with status 2 as argparse does.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` that refuses in one line: ``PROG: error: WHAT (see PROG --help)``,
    exit status 2. Sub-command parsers (:meth:`add_subparsers`) are of this class too."""

    def error(self, message: str) -> NoReturn:
        what = " ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(2, f"{self.prog}: error: {what} (see {self.prog} --help)\n")
