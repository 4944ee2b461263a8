"""``python -m atom_kv.ports --kv-transfer-config JSON [--tp N] [--dp N] [--pp N] [--http-port P]``

Prints the port plan of one engine: each rank's listeners and ports, then the
same as firewall rows (one range per listener kind, with who must reach it:
the proxy, decode engines, peer engines). Nothing is bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from atom_kv._cli import OneLineParser
from atom_kv.config import ConfigError, parse_kv_transfer_config
from atom_kv.ports import firewall_rows, planned_ports


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m atom_kv.ports", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-transfer-config", required=True, help="the engine's JSON config")
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", "--dp-size", "--data-parallel-size", dest="dp", type=int, default=1,
                   help="data-parallel ranks")
    p.add_argument("--pp", "--pp-size", dest="pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--http-port", type=int, default=None, help="the engine's HTTP port, listed first")
    p.add_argument("--json", action="store_true", help="one JSON object per listener instead of a table")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = parse_kv_transfer_config(args.kv_transfer_config)
        if config is None:
            raise ConfigError("kv-transfer-config: empty; a colocated engine opens no KV listener")
        plan = planned_ports(config, pp_size=args.pp, dp_size=args.dp, tp_size=args.tp, http_port=args.http_port)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for p in plan:
            print(json.dumps({"name": p.name, "rank": None if p.rank is None else list(p.rank), "port": p.port,
                              "last_port": p.ports[-1] if p.ports else p.port, "key": p.key}))
        return 0
    print(f"# {config.kv_role}, backend {config.backend}: pp {args.pp} x dp {args.dp} x tp {args.tp}")
    for p in plan:
        rank = "-" if p.rank is None else str(p.rank)
        ports = "OS-assigned" if not p.ports else (str(p.port) if len(p.ports) == 1 else
                                                   f"{p.ports[0]}-{p.ports[-1]}")
        print(f"{rank:<14} {p.name:<10} {ports:<12} {p.key}")
    print("# firewall: allow to this host, from whom each row says (docs/deploy.md, \"Firewall table\")")
    for row in firewall_rows(plan):
        print(f"{row.listener:<10} {row.ports:<26} from {row.allow_from}: {row.what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
