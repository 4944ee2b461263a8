"""Stop strings and stop token ids: when a request ends, and which tokens may be shown yet.

Generated tokens are byte tokens (one UTF-8 byte each; ids >= 256 carry no
text), so a stop string is matched on the bytes of the output. Output is cut
*before* the stop string, as vLLM and OpenAI do. Tokens that could be the
start of a stop string are held back until the next token decides it, so a
stream never shows text that a stop string later takes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

__all__ = ["StopChecker", "StopStep"]


@dataclass
class StopStep:
    """What one generated token decided: the tokens that may be shown now, and whether
    (and why) the request stopped."""

    release: list[int] = field(default_factory=list)
    stopped: bool = False
    stop_reason: Union[str, int, None] = None


class StopChecker:
    """Owns one request's stop conditions and its not-yet-shown tokens."""

    def __init__(self, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = ()) -> None:
        self._stops = [(s, s.encode("utf-8")) for s in stop if s]
        self._stop_ids = frozenset(stop_token_ids)
        self._text = bytearray()      # bytes of the tokens not shown yet
        self._held: list[int] = []    # tokens not shown yet
        self._held_bytes: list[int] = []  # bytes each held token contributed (0 or 1)

    @property
    def active(self) -> bool:
        return bool(self._stops or self._stop_ids)

    def push(self, token: int) -> StopStep:
        """Account for one generated token."""
        if token in self._stop_ids:  # the stop token itself is not shown
            return StopStep(release=self.flush(), stopped=True, stop_reason=token)
        piece = bytes([token]) if 0 <= token < 256 else b""
        self._held.append(token)
        self._held_bytes.append(len(piece))
        self._text += piece
        if not self._stops:
            return StopStep(release=self.flush())
        for text, raw in self._stops:
            # a match can only end at the newest byte: every earlier one was checked already
            if piece and self._text.endswith(raw):
                return StopStep(release=self._take_bytes(len(self._text) - len(raw)), stopped=True,
                                stop_reason=text)
        keep = self._longest_stop_prefix_suffix()
        return StopStep(release=self._take_bytes(len(self._text) - keep))

    def flush(self) -> list[int]:
        """Every held token (the request ends for another reason)."""
        out = self._held
        self._held, self._held_bytes, self._text = [], [], bytearray()
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of the held bytes that begins some stop string."""
        best = 0
        for _, raw in self._stops:
            for n in range(min(len(raw) - 1, len(self._text)), best, -1):
                if self._text.endswith(raw[:n]):
                    best = n
                    break
        return best

    def _take_bytes(self, n_bytes: int) -> list[int]:
        """Release the held tokens that make up the first ``n_bytes`` held bytes."""
        taken, used = 0, 0
        while taken < len(self._held) and used + self._held_bytes[taken] <= n_bytes:
            used += self._held_bytes[taken]
            taken += 1
        out = self._held[:taken]
        self._held = self._held[taken:]
        self._held_bytes = self._held_bytes[taken:]
        del self._text[:used]
        return out
