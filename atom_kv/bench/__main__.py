"""``python -m atom_kv.bench <suite> [options]``.

Each suite is a module ``atom_kv.bench.<suite>`` exposing
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). Every
suite prints its targets with met or MISSED and exits 1 when one is missed,
unless ``--explore`` (``atom_kv.bench.targets``, shared by every suite).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from atom_kv._cli import OneLineParser
from atom_kv.extras import MissingExtraError, require

#: suites that need an optional dependency: suite -> (module, extra)
NEEDS = {"chaos": ("torch", "reference"), "connector": ("torch", "reference"), "e2e": ("torch", "reference"),
         "routing": ("torch", "reference")}

SUITES = {
    "transfer": "raw backend read throughput (tcp, cma) against memcpy and socket ceilings",
    "connector": "connector transfer GB/s, handshake latency and per-request CPU overhead",
    "proxy": "proxy-added latency and throughput in front of fake engines",
    "admission": "admission control under a burst: queued in order, 429 past the queue, waits within the timeout",
    "e2e": "TTFT and tokens/s, P/D versus colocated, with the reference engine",
    "vllm": "TTFT through the proxy and two real vLLM servers (P/D) versus one plain vLLM server",
    "fleet": "the proxy against 2 to 1,000 fake engines: CPU per request, added latency, RSS, idle CPU on pings "
             "and probes, a new engine's time to its first request, KV index memory and ingest",
    "kv-index": "the proxy's KV event index: blocks/s decoded and applied on one core, bytes per entry",
    "routing": "routing policies on a multi-turn workload on reference engines: hit rate against an oracle, "
               "KV bytes moved, TTFT, proxy CPU",
    "chaos": "a seeded soak across simulated hosts (root): faults that overlap under traffic; no wrong answer, "
             "no hung request, no leaked block, no traceback",
}


def _module(suite: str) -> str:
    return f"atom_kv.bench.{suite.replace('-', '_')}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as the command line does: the suite named in it, with that suite's own flags (a bad
    suite or flag exits 2 in one line). The suite's module is imported; nothing runs."""
    parser = OneLineParser(prog="python -m atom_kv.bench", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="suite", required=True, metavar="{" + ",".join(SUITES) + "}")
    chosen = next((a for a in argv if a in SUITES), None)
    for name, help_text in SUITES.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            # Import only the suite being run: one suite's heavy or broken
            # imports never affect another.
            importlib.import_module(_module(name)).add_arguments(sub_parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in SUITES), None)
    if chosen in NEEDS:
        module, extra = NEEDS[chosen]
        try:
            require(module, extra=extra, feature=f"the {chosen} bench")
        except MissingExtraError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    suite = importlib.import_module(_module(args.suite))
    return int(suite.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
