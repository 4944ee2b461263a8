"""Server-sent events: cut a byte stream into whole events, and patch ``usage.prompt_tokens``.

The decode engine's stream arrives in arbitrary pieces (one TCP read may hold
half an event or several). :class:`EventFramer` turns it back into whole
events so the proxy forwards each one as its own write: a client measuring
inter-token latency sees the engine's timing, not the proxy's read sizes.

The partial event between two reads is held as a list of the reads (joined
once, when an event ends: never ``bytes +=`` per read, which is quadratic in
the event's size) and bounded: an event longer than ``max_event_bytes``
raises :class:`EventTooLarge` (an engine that never ends its event cannot
make the proxy hold its stream).
"""

from __future__ import annotations

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

DONE_EVENT = b"data: [DONE]\n\n"
DEFAULT_MAX_EVENT_BYTES = 64 * 1024 * 1024


class EventTooLarge(Exception):
    """One event of the stream is longer than the framer's bound (the message says how long)."""


def patch_usage(obj: object, prompt_tokens: int) -> bool:
    """Set ``usage.prompt_tokens`` (and keep ``total_tokens`` consistent); True if changed."""
    if not isinstance(obj, dict):
        return False
    usage = obj.get("usage")
    if not isinstance(usage, dict) or usage.get("prompt_tokens") == prompt_tokens:
        return False
    old = usage.get("prompt_tokens")
    usage["prompt_tokens"] = prompt_tokens
    total = usage.get("total_tokens")
    if isinstance(total, int) and isinstance(old, int):
        usage["total_tokens"] = total - old + prompt_tokens
    return True


def _patch_event(event: bytes, prompt_tokens: int) -> bytes:
    if b'"usage"' not in event:
        return event
    lines = event.split(b"\n")
    changed = False
    for i, line in enumerate(lines):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                obj = _decoder.decode(line[6:].rstrip(b"\r"))
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                continue
            if patch_usage(obj, prompt_tokens):
                lines[i] = b"data: " + _encoder.encode(obj)
                changed = True
    return b"\n".join(lines) if changed else event


class EventFramer:
    """Owns the partial event between two reads; yields whole events (with their blank line).

    With ``prompt_tokens`` set, events carrying ``usage`` get the prefill's
    prompt token count (the decode engine may count differently)."""

    __slots__ = ("prompt_tokens", "max_event_bytes", "_parts", "_held", "_tail")

    def __init__(self, prompt_tokens: int | None = None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # the partial event, as it arrived
        self._held = 0  # its length
        self._tail = b""  # its last 3 bytes (an event end split across two reads)

    def _hold(self, data: bytes) -> None:
        """Keep ``data`` (no event end in it) as the partial event."""
        self._parts = [data] if data else []
        self._held = len(data)
        self._tail = data[-3:]
        self._check()

    def _check(self) -> None:
        if self._held > self.max_event_bytes:
            raise EventTooLarge(f"an event of more than {self.max_event_bytes} bytes")

    def _with_pending(self, chunk: bytes) -> bytes | None:
        """The partial event plus ``chunk`` when they hold an event end; else None (``chunk`` is kept)."""
        if not self._parts:
            return chunk
        edge = self._tail + chunk[:3]
        if b"\n\n" in chunk or b"\r\n\r\n" in chunk or b"\n\n" in edge or b"\r\n\r\n" in edge:
            data = b"".join((*self._parts, chunk))
            self._parts, self._held, self._tail = [], 0, b""
            return data
        self._parts.append(chunk)
        self._held += len(chunk)
        self._tail = (self._tail + chunk)[-3:]
        self._check()
        return None

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._with_pending(chunk)
        if data is None:
            return []
        events = []
        start = 0
        has_cr = b"\r" in data
        while True:
            cut = data.find(b"\n\n", start)
            crlf = data.find(b"\r\n\r\n", start) if has_cr else -1
            if crlf >= 0 and (cut < 0 or crlf < cut):
                end = crlf + 4
            elif cut >= 0:
                end = cut + 2
            else:
                break
            events.append(data[start:end])
            start = end
        self._hold(data[start:])
        if self.prompt_tokens is not None:
            events = [_patch_event(e, self.prompt_tokens) for e in events]
        return events

    def feed_writes(self, chunk: bytes, split_max: int) -> list[tuple[bytes, bool]]:
        """The whole events in ``chunk`` grouped into writes: one per event when at most
        ``split_max`` arrived together, else one write for all. Each write comes with
        whether it ends the stream (its last event is ``[DONE]``)."""
        data = self._with_pending(chunk)
        if data is None:
            return []
        if b"\r" in data or (self.prompt_tokens is not None and b'"usage"' in data):
            events = self.feed(data)
            if len(events) <= split_max:
                return [(e, e == DONE_EVENT) for e in events]
            return [(b"".join(events), events[-1] == DONE_EVENT)] if events else []
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._hold(data)
            return []
        complete = data[: cut + 2]
        self._hold(data[cut + 2:])
        if complete.count(b"\n\n") <= split_max:
            return [(e + b"\n\n", e + b"\n\n" == DONE_EVENT) for e in complete[:-2].split(b"\n\n")]
        return [(complete, complete == DONE_EVENT or complete.endswith(b"\n\n" + DONE_EVENT))]

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an unterminated last event), patched too."""
        rest = b"".join(self._parts)
        self._parts, self._held, self._tail = [], 0, b""
        if rest and self.prompt_tokens is not None:
            rest = _patch_event(rest, self.prompt_tokens)
        return rest
