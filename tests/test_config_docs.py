"""docs/configuration.md lists every ``--kv-transfer-config`` key, and nothing that is not one."""

from __future__ import annotations

import os
import re

from atom_kv.config import KVTransferConfig

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")
#: keys only KVTransferConfig.from_dict reads (ATOM's), documented with the others
READ_BY_FROM_DICT = {"kv_connector_extra_config", "connectors"}


def test_every_config_key_has_a_row_in_docs_configuration_md():
    with open(DOC, encoding="utf-8") as f:
        rows = set(re.findall(r"^\| `([a-z][a-z0-9_]*)` \|", f.read(), re.M))
    fields = set(KVTransferConfig.__struct_fields__)
    assert sorted(fields - rows) == [], "keys without a row in docs/configuration.md"
    assert sorted(rows - fields - READ_BY_FROM_DICT) == [], "rows of docs/configuration.md that are no key"
