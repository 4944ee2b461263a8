"""docs/configuration.md lists every ``--kv-transfer-config`` key, and nothing that is not one: each section's
keys dotted (``tcp.streams``), each with the type msgspec.inspect gives and the Struct's default, and every
deprecated flat key with where it went."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import msgspec
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.config_sections import FLAT_KEYS, SECTIONS
from atom_kv.config_types import doc_type

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")
#: keys only KVTransferConfig.from_dict reads (ATOM's), documented with the others
READ_BY_FROM_DICT = {"kv_connector_extra_config", "connectors"}
KEY_TABLE = "| key | type | default | meaning |"
FLAT_TABLE = "| flat key (0.1) | write instead |"


def _cells(line: str) -> list[str]:
    """A table row's cells (a ``\\|`` inside a cell is no border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _tables(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of every table of ``text`` that starts with ``header``."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.strip() == header:
            inside = True
        elif inside and line.startswith("|"):
            if not line.startswith("|---"):
                rows.append(_cells(line))
        else:
            inside = False
    return rows


def _documented(rows: list[list[str]]) -> dict[str, list[str]]:
    out = {}
    for cells in rows:
        match = re.fullmatch(r"`([a-z][a-z0-9_.]*)`", cells[0])
        assert match, f"a key cell that is no `key`: {cells[0]}"
        out[match.group(1)] = cells
    return out


def _fields() -> dict[str, msgspec.structs.FieldInfo]:
    """Every key of the config, a section's dotted, with its field."""
    out = {f.name: f for f in msgspec.structs.fields(KVTransferConfig) if f.name not in SECTIONS}
    for key, cls in SECTIONS.items():
        out.update({f"{key}.{f.name}": f for f in msgspec.structs.fields(cls)})
    return out


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


@pytest.fixture(scope="module")
def doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def test_every_config_key_has_a_row_in_docs_configuration_md(doc):
    rows = set(_documented(_tables(doc, KEY_TABLE)))
    fields = set(_fields())
    assert sorted(fields - rows) == [], "keys without a row in docs/configuration.md"
    assert sorted(rows - fields - READ_BY_FROM_DICT) == [], "rows of docs/configuration.md that are no key"


def test_each_row_gives_the_keys_type_and_default(doc):
    rows = _documented(_tables(doc, KEY_TABLE))
    wrong = []
    for key, field in _fields().items():
        _, type_cell, default_cell, _ = rows[key]
        words = doc_type(field.type)
        if type_cell != words and not type_cell.startswith(words + ", "):  # ", below `tcp.max_connections`"
            wrong.append(f"{key}: type {type_cell!r}, the Struct says {words!r}")
        default = _default(field)
        shown = "required" if default is msgspec.NODEFAULT else f"`{json.dumps(msgspec.to_builtins(default))}`"
        if default_cell != shown and not default_cell.startswith((shown + " ", shown + ";")):  # "`null` (`3.0`)"
            wrong.append(f"{key}: default {default_cell!r}, the Struct says {shown!r}")
    assert wrong == []


def test_every_section_has_a_heading_and_a_sentence(doc):
    for key in SECTIONS:
        match = re.search(rf"^### `{key}`: .+\n\n(\S.+)$", doc, re.M)
        assert match, f"no '### `{key}`: ...' heading followed by a sentence"


def test_every_deprecated_flat_key_is_listed_with_where_it_went(doc):
    listed = {}
    for cells in _tables(doc, FLAT_TABLE):
        old, new = (re.fullmatch(r"`([a-z0-9_.]+)`", c).group(1) for c in cells)  # type: ignore[union-attr]
        listed[old] = new
    assert listed == {old: f"{s}.{f}" for old, (s, f) in FLAT_KEYS.items()}

