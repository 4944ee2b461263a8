"""The proxy's tokens off the command line: ``--registration-token-file`` and ``--admin-token-file``
beside the inline flags, and the variables :data:`REGISTRATION_TOKEN_ENV` and :data:`ADMIN_TOKEN_ENV`.

One rule (atom_kv.token_sources): a flag and its file flag together are refused; either wins over the
variable, read only when neither is given. A token given inline logs one warning naming its file flag.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Mapping, NamedTuple, Optional

from atom_kv.token_sources import TokenSource, inline_warning, resolve_token

__all__ = ["ADMIN_TOKEN_ENV", "REGISTRATION_TOKEN_ENV", "add_token_file_arguments", "resolve_token_arguments"]

logger = logging.getLogger("atom_kv.proxy")

REGISTRATION_TOKEN_ENV = "ATOM_KV_REGISTRATION_TOKEN"
ADMIN_TOKEN_ENV = "ATOM_KV_ADMIN_TOKEN"


class _TokenFlags(NamedTuple):
    dest: str  # the ProxySettings field
    flag: str
    file_flag: str
    env: str


_TOKENS = (
    _TokenFlags("registration_token", "--registration-token", "--registration-token-file", REGISTRATION_TOKEN_ENV),
    _TokenFlags("admin_token", "--admin-token", "--admin-token-file", ADMIN_TOKEN_ENV),
)


def _file_dest(token: _TokenFlags) -> str:
    return token.dest + "_file"


def add_token_file_arguments(parser: argparse.ArgumentParser) -> None:
    """The file flags, in a group of their own."""
    g = parser.add_argument_group("tokens kept out of the process list",
                                  f"a file flag and its inline flag are never given together; either wins over "
                                  f"{REGISTRATION_TOKEN_ENV} / {ADMIN_TOKEN_ENV}")
    g.add_argument("--registration-token-file", metavar="PATH", default=None,
                   help="read --registration-token from this file (mode 0600, one line; create it with "
                        "'(umask 077; openssl rand -hex 32 > PATH)'); else the variable " + REGISTRATION_TOKEN_ENV)
    g.add_argument("--admin-token-file", metavar="PATH", default=None,
                   help="read --admin-token from this file (mode 0600, one line); else the variable "
                        + ADMIN_TOKEN_ENV)


def resolve_token_arguments(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> None:
    """Set ``args.registration_token`` and ``args.admin_token`` from their flag, file or variable, and drop the
    file flags' attributes (which are no settings). Logs one warning per token given inline. Raises
    :class:`atom_kv.token_sources.TokenSourceError` (one line naming the flag)."""
    env = os.environ if environ is None else environ
    for token in _TOKENS:
        resolved = resolve_token(inline=getattr(args, token.dest), file=getattr(args, _file_dest(token), None),
                                 env=token.env, inline_name=token.flag, file_name=token.file_flag, environ=env)
        if resolved.source is TokenSource.INLINE:
            logger.warning("%s", inline_warning(token.flag, token.file_flag, token.env))
        setattr(args, token.dest, resolved.value)
        if hasattr(args, _file_dest(token)):
            delattr(args, _file_dest(token))
