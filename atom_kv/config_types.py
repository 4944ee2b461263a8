"""The constrained field types the package shares, their descriptions in
words, and field-by-field conversion that names the key of a bad value.

Ranges live in the types (``Annotated[int, msgspec.Meta(ge=..., le=...)]``,
declared once below); msgspec checks them. :func:`convert_fields` converts a
mapping's values one at a time, so a failure becomes one line naming the key
("`tcp.streams` must be >= 1, got 0"). What a type allows is read from
``msgspec.inspect.type_info``: its bounds, its ``min_length``, and a
``Meta(description=...)`` where the bounds alone would not say it well.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args, get_origin

import msgspec
import msgspec.inspect as mi

__all__ = [
    "MAX_PORT",
    "MAX_RANGES_PER_REQUEST",
    "ConfigError",
    "FieldError",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PeerPort",
    "Port",
    "PositiveInt",
    "PositiveSeconds",
    "RangesPerRequest",
    "convert_fields",
    "describe_allowed",
    "describe_type",
    "doc_type",
    "is_port",
    "validate_fields",
]


class ConfigError(ValueError):
    """A ``--kv-transfer-config`` problem, phrased for the operator in one line."""


class FieldError(ValueError):
    """One field of a mapping failed validation; ``key`` names it and the
    message says what is allowed: "`key` must be <allowed>, got <value>"."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------
# Constrained types: the one place each range is written down.
# --------------------------------------------------------------------------
MAX_PORT = 65535
_MAX_FLOAT = sys.float_info.max  # an upper bound keeps inf out (nan fails every bound); never said in words

#: a port to listen on; 0 lets the OS pick
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT, description=f"a TCP port in 0..{MAX_PORT}")]
#: a port to connect to
PeerPort = Annotated[int, msgspec.Meta(ge=1, le=MAX_PORT, description=f"a TCP port in 1..{MAX_PORT}")]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=_MAX_FLOAT, description="a positive number of seconds")]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0, le=_MAX_FLOAT)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
#: ranges one tcp read request may name (bounds the request frames a read server accepts)
MAX_RANGES_PER_REQUEST = 1 << 20
RangesPerRequest = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANGES_PER_REQUEST)]


def is_port(value: Any, *, allow_zero: bool = True) -> bool:
    """True when ``value`` is an int in 0..65535 (1..65535 without ``allow_zero``)."""
    try:
        msgspec.convert(value, Port if allow_zero else PeerPort)
    except msgspec.ValidationError:
        return False
    return True


# --------------------------------------------------------------------------
# Types in words, from msgspec.inspect
# --------------------------------------------------------------------------
_SHAPE_WORDS: dict[type, str] = {
    mi.StrType: "a string",
    mi.IntType: "an integer",
    mi.FloatType: "a number",
    mi.BoolType: "true or false",
    mi.NoneType: "null",
    mi.ListType: "a list",
    mi.DictType: "an object",
    mi.StructType: "an object",
}
_DOC_WORDS: dict[type, str] = {
    mi.StrType: "string", mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool",
    mi.NoneType: "null", mi.DictType: "object", mi.StructType: "object",
}


class _Described(msgspec.Struct, frozen=True):
    """One declared type, inspected once: msgspec's view of it and the order its ``Literal`` values were written in
    (msgspec sorts them; a message lists them as declared)."""

    info: mi.Type
    literal_order: dict[frozenset[Any], tuple[Any, ...]]

    def literal_values(self, t: mi.LiteralType) -> tuple[Any, ...]:
        return self.literal_order.get(frozenset(t.values), t.values)


def _literal_orders(tp: Any, out: dict[frozenset[Any], tuple[Any, ...]]) -> dict[frozenset[Any], tuple[Any, ...]]:
    if get_origin(tp) is Literal:
        out[frozenset(get_args(tp))] = get_args(tp)
    for arg in get_args(tp):
        _literal_orders(arg, out)
    return out


@functools.lru_cache(maxsize=None)
def _described(tp: Any) -> _Described:
    return _Described(mi.type_info(tp), _literal_orders(tp, {}))


def _without_null(t: mi.UnionType) -> tuple[list[mi.Type], bool]:
    parts = [p for p in t.types if not isinstance(p, mi.NoneType)]
    return parts, len(parts) < len(t.types)


def _shape(d: _Described, t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _shape(d, t.type)
    if isinstance(t, mi.UnionType):
        parts, null = _without_null(t)
        words = " or ".join(_shape(d, p) for p in parts)
        return f"{words} or null" if null else words
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in d.literal_values(t))
    return _SHAPE_WORDS.get(type(t), type(t).__name__)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(t: mi.IntType | mi.FloatType) -> Optional[str]:
    """``"in 1..16"``, ``">= 0"``, ``"> 0"``; None without bounds (an upper bound of the largest float is no bound)."""
    low = (">=", t.ge) if t.ge is not None else (">", t.gt) if t.gt is not None else None
    high = ("<=", t.le) if t.le is not None and t.le != _MAX_FLOAT else ("<", t.lt) if t.lt is not None else None
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"in {_number(low[1])}..{_number(high[1])}"
    words = [f"{part[0]} {_number(part[1])}" for part in (low, high) if part]
    return " and ".join(words) or None


def _lengths(t: mi.StrType | mi.ListType) -> Optional[str]:
    lo, hi = t.min_length, t.max_length
    if lo and hi:
        return f"of {lo}..{hi}"
    if hi is not None:
        return f"of at most {hi}"
    return "non-empty" if lo == 1 else f"of at least {lo}" if lo else None


def _allowed(d: _Described, t: mi.Type) -> Optional[str]:
    """What the constraints of ``t`` allow, in words; None where it has none."""
    if isinstance(t, mi.Metadata):
        description = (t.extra_json_schema or {}).get("description")
        return description if isinstance(description, str) else _allowed(d, t.type)
    if isinstance(t, mi.UnionType):
        return next((w for p in _without_null(t)[0] if (w := _allowed(d, p))), None)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        bounds = _bounds(t)
        if bounds and bounds.startswith("in "):
            return f"{_shape(d, t)} {bounds}"
        return bounds
    if isinstance(t, (mi.StrType, mi.ListType)):
        length = _lengths(t)
        noun = "a string" if isinstance(t, mi.StrType) else "a list"
        unit = " characters" if isinstance(t, mi.StrType) else " items"
        if length is None:
            return None
        return f"a non-empty {noun[2:]}" if length == "non-empty" else f"{noun} {length}{unit}"
    return None


def describe_type(tp: Any) -> str:
    """What values of type ``tp`` look like, in words ("an integer or null")."""
    d = _described(tp)
    return _shape(d, d.info)


def describe_allowed(tp: Any) -> str:
    """What type ``tp`` allows, in words: its description, else its bounds ("an integer in 2..16", ">= 1"),
    else its shape (:func:`describe_type`)."""
    d = _described(tp)
    return _allowed(d, d.info) or _shape(d, d.info)


def doc_type(tp: Any) -> str:
    """``tp`` as docs/configuration.md's type column writes it: ``int >= 1``, ``float > 0 or null``,
    ``"rdma"`` | ``"xgmi"`` (the bar escaped for a table)."""
    d = _described(tp)
    return _doc(d, d.info)


def _doc(d: _Described, t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _doc(d, t.type)
    if isinstance(t, mi.UnionType):
        parts, null = _without_null(t)
        words = " or ".join(_doc(d, p) for p in parts)
        return f"{words} or null" if null else words
    if isinstance(t, mi.LiteralType):
        return r" \| ".join(f"`{json.dumps(v)}`" for v in d.literal_values(t))
    if isinstance(t, (mi.IntType, mi.FloatType)):
        bounds = _bounds(t)
        return f"{_DOC_WORDS[type(t)]} {bounds}" if bounds else _DOC_WORDS[type(t)]
    if isinstance(t, mi.StrType):
        return "non-empty string" if t.min_length else "string"
    if isinstance(t, mi.ListType):
        items = _doc(d, t.item_type)
        return f"{'non-empty ' if t.min_length else ''}list of {items}s"
    return _DOC_WORDS.get(type(t), type(t).__name__)


def _bare(t: mi.Type, d: _Described) -> Any:
    """The Python type of ``t`` with every constraint removed (same shape): what a value is converted to for
    showing it in a range error ("got -1.0")."""
    if isinstance(t, mi.Metadata):
        return _bare(t.type, d)
    if isinstance(t, mi.UnionType):
        return Union[tuple(_bare(p, d) for p in t.types)]
    if isinstance(t, mi.ListType):
        return list[_bare(t.item_type, d)]  # type: ignore[misc]  # a type built at run time
    if isinstance(t, mi.LiteralType):
        return Literal[d.literal_values(t)]
    if isinstance(t, mi.StructType):
        return t.cls
    return {mi.StrType: str, mi.IntType: int, mi.FloatType: float, mi.BoolType: bool,
            mi.NoneType: type(None), mi.DictType: dict}.get(type(t), Any)


# --------------------------------------------------------------------------
# Field-by-field conversion: msgspec validates, we name the key.
# --------------------------------------------------------------------------
class _Field(msgspec.Struct, frozen=True):
    type: Any
    bare: Any
    type_words: str
    range_words: str


@functools.lru_cache(maxsize=None)
def _fields_of(cls: type) -> dict[str, _Field]:
    out = {}
    for f in msgspec.structs.fields(cls):
        d = _described(f.type)
        out[f.name] = _Field(f.type, _bare(d.info, d), describe_type(f.type), describe_allowed(f.type))
    return out


def convert_fields(data: Mapping[str, Any], cls: type, *, prefix: str = "") -> dict[str, Any]:
    """``data``'s values for the fields of Struct ``cls``, each converted by
    msgspec to its declared (constrained) type; other keys are left out.

    Raises :class:`FieldError` for the first key whose value has the wrong
    type ("`key` must be an integer, got '7'") or, when all types are right,
    the first one out of range ("`key` must be a TCP port in 0..65535, got 70000",
    showing the value as converted). ``prefix`` goes before each key in the
    error ("tcp." names `tcp.streams`).
    """
    out, errors = validate_fields(data, cls, prefix=prefix)
    if errors:
        raise errors[0]
    return out


def validate_fields(data: Mapping[str, Any], cls: type, *,
                    prefix: str = "") -> tuple[dict[str, Any], list[FieldError]]:
    """Each of ``data``'s values for the fields of Struct ``cls`` checked on its
    own: the converted values of the keys that validate (other keys are left
    out), and one :class:`FieldError` per key that does not, those of the wrong
    type first, then those out of range, each group in ``data``'s order (so
    the first is what :func:`convert_fields` raises)."""
    fields = _fields_of(cls)
    out: dict[str, Any] = {}
    wrong_type: list[FieldError] = []
    out_of_range: list[FieldError] = []
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            continue
        try:
            out[key] = msgspec.convert(value, field.type)
            continue
        except msgspec.ValidationError:
            pass
        name = f"{prefix}{key}"
        try:
            shown = msgspec.convert(value, field.bare)
        except msgspec.ValidationError:
            wrong_type.append(FieldError(name, f"`{name}` must be {field.type_words}, got {value!r}"))
        else:
            out_of_range.append(FieldError(name, f"`{name}` must be {field.range_words}, got {shown!r}"))
    return out, wrong_type + out_of_range
