"""``python -m atom_kv.integrations.atom install-hook|remove-hook|hook-status [--site DIR]``.

Writes or removes ``atom_kv_atom.pth`` (see :mod:`atom_kv.integrations.atom.hook`)
in this interpreter's site-packages, for installs that do not ship it
(``pip install -e``).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

from atom_kv._cli import OneLineParser
from atom_kv.integrations.atom.hook import PTH_NAME, pth_text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        prog="python -m atom_kv.integrations.atom",
        description=f"Install or remove {PTH_NAME}, which registers the atom_kv KV connector in every ATOM "
                    "process. A wheel install ships it; `pip install -e` does not.",
    )
    parser.add_argument("action", choices=["install-hook", "remove-hook", "hook-status"])
    parser.add_argument("--site", help="site-packages directory (default: this interpreter's)")
    args = parser.parse_args(argv)
    site = Path(args.site) if args.site else Path(sysconfig.get_paths()["purelib"])
    target = site / PTH_NAME
    if args.action == "install-hook":
        if not site.is_dir():
            parser.exit(2, f"error: {site} is not a directory; pass --site with a site-packages path\n")
        target.write_text(pth_text())
        print(f"installed {target}")
    elif args.action == "remove-hook":
        if target.exists():
            target.unlink()
            print(f"removed {target}")
        else:
            print(f"nothing to remove: {target} does not exist")
    elif not target.exists():
        print(f"{target}: not installed")
    else:
        print(f"{target}: " + ("installed" if target.read_text() == pth_text() else "differs from this version; "
                                "run install-hook again"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
