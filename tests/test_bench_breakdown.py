"""The breakdown bench's pure parts: the P/D modes it compares and its argument checks."""

import argparse

from atom_kv.bench import e2e
from atom_kv.bench.breakdown import MODES, run_breakdown
from atom_kv.proxy.__main__ import build_parser


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(["--breakdown", *argv])


def test_an_unknown_mode_is_refused_in_one_line_before_anything_starts(capsys):
    assert run_breakdown(_args("--modes", "first_token,warp")) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "'warp'" in out and "sequential, first_token, concurrent" in out


def test_every_mode_is_a_set_of_flags_the_proxy_takes():
    parser = build_parser()
    for name, flags in MODES.items():
        args = parser.parse_args(flags)
        assert args.concurrent_dispatch is (name == "concurrent"), name
        assert args.first_token_forwarding is (name != "sequential"), name
