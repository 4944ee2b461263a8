"""Which UCX transports a NIXL agent's transfers went over, logged once per agent.

UCX chooses a transport per operation (``cma``, ``sysv``/``posix`` shared
memory, ``tcp``, ``cuda_ipc``, ``cuda_copy``, ``rc``...) when the operation
first runs, and with ``UCX_PROTO_INFO=y`` prints each choice as a table.
With ``nixl.ucx_proto_info`` on, the backend has UCX print those tables to
a file of its own (``UCX_LOG_FILE``, in a private temporary folder), and
after the agent's first completed read logs one line saying, per
operation, the transports UCX chose (docs/nixl.md, "UCX transports on one
node"). UCX's other messages go to that file as well while the key is on:
they are logged as warnings with the report.

UCX reads both variables when it is first loaded in a process, so the key
takes effect only if no NIXL agent was made in the process before.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from typing import Optional

__all__ = ["TransportReport", "enable_proto_info", "parse_proto_tables"]

logger = logging.getLogger(__name__)

#: a table line of UCX's protocol report: "[time] [host:pid:thread]   | ... |"
_LINE = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*(.*)$")
#: most of UCX's other lines forwarded with one report
MAX_FORWARDED = 20


def enable_proto_info() -> Optional[str]:
    """Have UCX print its protocol choices into a file of this process (unless the
    environment already says where); returns the file's path pattern, or None
    when UCX was told otherwise by the environment (then nothing is set)."""
    if os.environ.get("UCX_PROTO_INFO", "y").lower() not in ("y", "yes", "1", "on"):
        return None
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    if "UCX_LOG_FILE" not in os.environ:
        os.environ["UCX_LOG_FILE"] = os.path.join(tempfile.mkdtemp(prefix="atom-kv-ucx-"), "ucx.%p.log")
    return os.environ["UCX_LOG_FILE"]


def parse_proto_tables(text: str, agent: str) -> tuple[dict[str, list[str]], list[str]]:
    """From UCX's log: per operation of ``agent``'s tables, the transports of its
    rows (in order, without repeats), and the lines that belong to no table."""
    choices: dict[str, list[str]] = {}
    other: list[str] = []
    title: list[str] = []
    mine = False
    operation = ""
    for raw in text.splitlines():
        m = _LINE.match(raw)
        body = (m.group(1) if m else raw).strip()
        if not body:
            continue
        if body.startswith("+"):
            title = []
            continue
        if not body.startswith("|"):
            other.append(body)
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if len(cells) == 1:  # a title line: "<agent> <peer> cfg#N", then the operation
            title.append(cells[0])
            if len(title) == 1:
                mine = cells[0].split(" ", 1)[0] == agent
            elif len(title) == 2:
                operation = cells[0]
            continue
        if not mine or not operation or cells[0] in ("Range",):
            continue
        transports = choices.setdefault(operation, [])
        for t in (x.strip() for x in cells[-1].split(",")):
            if t and t not in transports:
                transports.append(t)
    return choices, other


class TransportReport:
    """Owns one agent's report: the UCX log file to read and whether it was logged yet."""

    def __init__(self, agent: str, pattern: Optional[str]) -> None:
        self._agent = agent
        self._path = pattern.replace("%p", str(os.getpid())) if pattern else None
        self.done = pattern is None

    def log(self) -> None:
        """Log the transports UCX chose for this agent's transfers so far (once)."""
        path = self._path
        if self.done or path is None:  # no path: no report was asked for (done from the start)
            return
        self.done = True
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            logger.info("nixl %s: UCX printed no protocol report (%s): UCX was loaded in this process before "
                        "`nixl.ucx_proto_info` could take effect", self._agent, exc.strerror)
            return
        choices, other = parse_proto_tables(text, self._agent)
        for line in other[:MAX_FORWARDED]:
            logger.warning("nixl %s: UCX: %s", self._agent, line)
        if not choices:
            logger.info("nixl %s: UCX reported no protocol choice for this agent (in %s)", self._agent, self._path)
            return
        summary = "; ".join(f"{op}: {', '.join(ts)}" for op, ts in choices.items())
        logger.info("nixl %s: UCX transports chosen: %s (UCX_TLS=%s)", self._agent, summary,
                    os.environ.get("UCX_TLS", "unset: every transport UCX finds"))
