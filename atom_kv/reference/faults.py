"""A test-only fault injector: fails chosen requests at a chosen stage of their processing.

``--inject-request-fault STAGE=MARKER`` (repeatable) makes every request whose
prompt contains MARKER (its UTF-8 bytes) raise :class:`InjectedFault` at STAGE:

- ``admit``: while the scheduler admits it (blocks allocated, the connector
  asked about it);
- ``sample``: while any of its tokens is sampled;
- ``decode``: while any token after its first is sampled (a stream has begun);
- ``finish``: while the connector is told it ended (a prefill's handoff).

It exists to show that one request's failure stays its own: that request is
answered with a 500 (or an error event in its stream), its blocks are freed and
the connector releases what it holds for it, and the engine keeps serving.
Never set it in production.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from atom_kv.reference.request import Request

__all__ = ["FLAG", "FaultInjector", "FaultStage", "InjectedFault"]

FLAG = "--inject-request-fault"


class FaultStage(enum.Enum):
    ADMIT = "admit"
    SAMPLE = "sample"
    DECODE = "decode"
    FINISH = "finish"


class InjectedFault(RuntimeError):
    """Raised by :class:`FaultInjector` in a request it was told to fail."""


@dataclass(frozen=True)
class FaultInjector:
    """Owns the (stage, prompt marker) pairs of ``--inject-request-fault``; empty: injects nothing."""

    faults: tuple[tuple[FaultStage, bytes], ...] = field(default=())

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...]) -> "FaultInjector":
        """``["sample=MARKER", ...]``; raises ValueError (one line naming the flag) for anything else."""
        faults = []
        for spec in specs:
            stage, sep, marker = spec.partition("=")
            try:
                which = FaultStage(stage)
            except ValueError:
                which = None
            if not sep or which is None or not marker:
                stages = ", ".join(s.value for s in FaultStage)
                raise ValueError(f"{FLAG} must be STAGE=MARKER with STAGE one of {stages} and a non-empty "
                                 f"MARKER, got {spec!r}")
            faults.append((which, marker.encode("utf-8", errors="replace")))
        return cls(tuple(faults))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def check(self, stage: FaultStage, req: Request) -> None:
        """Raise :class:`InjectedFault` if ``req`` is to fail at ``stage``."""
        if not self.faults:
            return
        for which, marker in self.faults:
            if which is stage and marker in bytes(t for t in req.prompt_ids if 0 <= t < 256):
                raise InjectedFault(f"fault injected by {FLAG} {stage.value}={marker.decode(errors='replace')}")
