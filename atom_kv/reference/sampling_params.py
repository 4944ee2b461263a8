"""What a request may ask of the sampler: each sampling field's allowed values, checked in one place.

Every number is checked to be finite and within its range before it reaches
the engine (a request body is parsed strictly, but an in-process caller can
still pass NaN). A bad value is a :class:`RequestError` (400) naming the field
and what it accepts:

- ``temperature``: null, 0 (greedy) or a finite number in
  :data:`MIN_TEMPERATURE`..:data:`MAX_TEMPERATURE`. Below 0.01 the
  distribution is greedy in all but name (vLLM clamps such values to 0.01);
  the engine refuses them rather than guess.
- ``seed``: null or an integer in 0..2**64-1.
- ``max_tokens`` / ``max_completion_tokens``: null or an integer >= 1 (the
  scheduler checks it against ``--max-model-len``).
- ``n``: null or 1.
- What the engine does not implement (:data:`UNSUPPORTED`: ``top_p``,
  ``top_k``, the penalties, ``min_p``, ...): null or the field's neutral value
  only (``top_p`` 1, ``top_k`` 0 or -1, penalties 0, ``repetition_penalty`` 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from atom_kv.reference.request import RequestError

__all__ = ["MAX_SEED", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "UNSUPPORTED", "SamplingParams", "int_field", "is_int",
           "is_number", "parse_sampling", "shown"]

#: the smallest temperature above 0 accepted (vLLM's floor)
MIN_TEMPERATURE = 0.01
#: the largest temperature accepted (far past uniform over the allowed tokens)
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """The validated sampling settings of one request."""

    max_tokens: int
    temperature: float
    seed: Optional[int]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (booleans are not numbers)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value))


def int_field(body: dict, key: str, default: Optional[int], minimum: int,
              maximum: Optional[int] = None) -> Optional[int]:
    """``body[key]`` as an integer in ``minimum..maximum`` (null: ``default``)."""
    value = body.get(key, default)
    if value is None:
        return None
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise RequestError(f"`{key}` must be an integer {allowed}, got {shown(value)}", param=key)
    return value


def _temperature(body: dict) -> float:
    value = body.get("temperature")
    if value is None:
        return 0.0
    if is_number(value) and (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        return float(value)
    raise RequestError(f"`temperature` must be 0 (greedy) or a number in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, "
                       f"got {shown(value)}", param="temperature")


def _equals(*defaults: Any) -> Callable[[Any], bool]:
    """A predicate: the value is one of ``defaults`` (compared with their types, so 0 != False)."""
    return lambda v: any(type(v) is type(d) and v == d for d in defaults) or (
        is_number(v) and any(is_number(d) and v == d for d in defaults))


#: Parameters this engine does not implement: (key, "is the value a default?", what is accepted).
#: A default value (or null) is accepted; anything else is refused rather than ignored.
UNSUPPORTED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("logprobs", _equals(False), "null or false"),
    ("top_logprobs", _equals(0), "null or 0"),
    ("prompt_logprobs", lambda v: False, "null"),
    ("echo", _equals(False), "null or false"),
    ("logit_bias", lambda v: v == {}, "null or {}"),
    ("best_of", _equals(1), "null or 1"),
    ("suffix", _equals(""), 'null or ""'),
    ("response_format", lambda v: v == {"type": "text"}, 'null or {"type": "text"}'),
    ("tools", lambda v: v == [], "null or []"),
    ("tool_choice", _equals("none", "auto"), 'null, "none" or "auto"'),
    ("presence_penalty", _equals(0), "null or 0"),
    ("frequency_penalty", _equals(0), "null or 0"),
    ("repetition_penalty", _equals(1), "null or 1"),
    ("top_p", _equals(1), "null or 1"),
    ("top_k", _equals(0, -1), "null, 0 or -1"),
    ("min_p", _equals(0), "null or 0"),
    ("min_tokens", _equals(0), "null or 0"),
    ("include_stop_str_in_output", _equals(False), "null or false"),
]


def _refuse_unsupported(body: dict) -> None:
    for key, is_default, accepted in UNSUPPORTED:
        value = body.get(key)
        if value is not None and not is_default(value):
            raise RequestError(f"`{key}` is not supported by this engine (got {shown(value)}); send {accepted}",
                               param=key)


def parse_sampling(body: dict, *, chat: bool, default_max_tokens: int) -> SamplingParams:
    """The sampling fields of a completions (``chat=False``) or chat body; raises
    :class:`RequestError` naming the first bad one."""
    max_tokens = int_field(body, "max_completion_tokens", None, 1) if chat else None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", default_max_tokens, 1) or default_max_tokens
    if int_field(body, "n", 1, 1) != 1:
        raise RequestError("only `n` = 1 is supported", param="n")
    temperature = _temperature(body)
    seed = int_field(body, "seed", None, 0, MAX_SEED)
    _refuse_unsupported(body)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error message never echoes a whole body);
    an integer too long to print names its digit count instead."""
    if is_int(value) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
