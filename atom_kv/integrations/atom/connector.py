"""The module an ATOM that resolves ``kv_connector_module_path`` imports (docs/atom-upstream.md).

``--kv-transfer-config '{"kv_connector": "atom_kv", "kv_connector_module_path":
"atom_kv.integrations.atom.connector", ...}'``: importing it registers
``atom_kv`` on ATOM's ``KVConnectorFactory``, so no start-up hook is needed.
"""

from atom_kv.integrations.atom.hook import register

register()
