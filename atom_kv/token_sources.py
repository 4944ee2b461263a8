"""Where a token comes from: a file only its owner may open, an environment variable, or the command
line itself (which every user of the host can read with ``ps``).

One rule for every token (the engines' ``auth_token``, the proxy's ``--registration-token`` and
``--admin-token``): the inline value and the file are never given together (refused in one line);
either wins over the environment variable, which is read only when neither is given. A token file is
read as ssh reads a private key: refused, in one line, when group or others may open it, when it is
empty, or when it is anything but one line of text (one trailing newline is stripped).
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["MAX_TOKEN_FILE_BYTES", "ResolvedToken", "TokenSource", "TokenSourceError", "create_hint",
           "inline_warning", "read_token_file", "resolve_token"]

#: the largest token file read (a token is one line; this bounds what a wrong path makes us read)
MAX_TOKEN_FILE_BYTES = 4096


def create_hint(path: str) -> str:
    """The commands that create a token file at ``path`` (docs/security.md)."""
    return f"(umask 077; openssl rand -hex 32 > {path})"


class TokenSourceError(ValueError):
    """A token's file, variable or flag cannot be used; the message is one line saying what to do."""


class TokenSource(enum.Enum):
    """Where a resolved token came from."""

    NONE = "none"
    INLINE = "inline"
    FILE = "file"
    ENV = "env"


@dataclass(frozen=True)
class ResolvedToken:
    """A token (None: no token) and where it came from."""

    value: Optional[str]
    source: TokenSource


def read_token_file(path: str, option: str) -> str:
    """The token in the file at ``path``, which ``option`` named (e.g. ``--registration-token-file``).

    Raises :class:`TokenSourceError` (one line naming ``option`` and ``path``) when the file cannot be
    opened, is not a regular file, is open to group or others (mode & 0o077, as ssh refuses a key), is
    larger than :data:`MAX_TOKEN_FILE_BYTES`, is not UTF-8, is empty, or holds more than one line.
    One trailing newline (``\\n`` or ``\\r\\n``) is not part of the token.
    """
    try:
        # O_NONBLOCK: a FIFO at the path must not block the open (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TokenSourceError(f"{option}: {path} does not exist; create it with: {create_hint(path)}") from None
    except PermissionError:
        raise TokenSourceError(f"{option}: {path} cannot be read by this user (uid {os.getuid()}); run as the "
                               "file's owner, or give this user its own copy (chmod 600)") from None
    except OSError as exc:
        raise TokenSourceError(f"{option}: cannot open {path}: {exc.strerror or exc}") from None
    try:
        data = _read_checked(fd, path, option)
    finally:
        os.close(fd)
    return _token_of(data, path, option)


def _read_checked(fd: int, path: str, option: str) -> bytes:
    info = os.fstat(fd)  # of the file opened, not of whatever the path names by now
    if not stat.S_ISREG(info.st_mode):
        raise TokenSourceError(f"{option}: {path} is not a regular file; give the path of a file holding the token")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        what = "readable" if mode & 0o044 else "writable"
        raise TokenSourceError(f"{option}: {path} is {what} by group or others (mode {mode:04o}); chmod 600 it")
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_TOKEN_FILE_BYTES:
        chunk = os.read(fd, MAX_TOKEN_FILE_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_TOKEN_FILE_BYTES:
        raise TokenSourceError(f"{option}: {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes; a token file holds "
                               "the token alone")
    return b"".join(chunks)


def _token_of(data: bytes, path: str, option: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenSourceError(f"{option}: {path} is not UTF-8 text; a token file holds the token alone") from None
    if text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if not text:
        raise TokenSourceError(f"{option}: {path} is empty; put a token in it: {create_hint(path)}")
    if "\n" in text or "\r" in text:
        raise TokenSourceError(f"{option}: {path} holds more than one line; a token file holds the token alone "
                               "(one trailing newline is allowed)")
    return text


def resolve_token(*, inline: Optional[str], file: Optional[str], env: str, inline_name: str, file_name: str,
                  environ: Optional[Mapping[str, str]] = None) -> ResolvedToken:
    """The token given inline (``inline_name``), in a file (``file_name``), or in the variable ``env``.

    Inline and file together are refused; either wins over ``env``, which is read only when neither is
    given (an empty variable is refused: unset it instead). Raises :class:`TokenSourceError`.
    """
    if inline is not None and file is not None:
        raise TokenSourceError(f"{inline_name} and {file_name} are both given; give one of them "
                               f"({file_name} keeps the token out of the process list)")
    if file is not None:
        return ResolvedToken(read_token_file(file, file_name), TokenSource.FILE)
    if inline is not None:
        return ResolvedToken(inline, TokenSource.INLINE)
    value = (os.environ if environ is None else environ).get(env)
    if value is None:
        return ResolvedToken(None, TokenSource.NONE)
    if not value:
        raise TokenSourceError(f"{env} is set but empty; unset it, or set it to the token")
    return ResolvedToken(value, TokenSource.ENV)


def inline_warning(inline_name: str, file_name: str, env: str) -> str:
    """The one warning line for a token given inline."""
    return (f"{inline_name} given inline is visible to every user of this host (ps, /proc/PID/cmdline); put the "
            f"token in a file only you can read and use {file_name} instead, or set {env}")
