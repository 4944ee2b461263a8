"""Optional dependencies ("extras") and the one-line error when one is missing.

``pip install atom-kv`` gives the proxy, the connector and its backends;
``atom-kv[reference]`` adds torch for the reference engine, the demo and the
connector and e2e benches; ``atom-kv[mori]`` adds MORI-IO; ``atom-kv[otel]``
the proxy's OpenTelemetry export (``--otlp-traces-endpoint``).
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed; the message says what to install."""


def require(module: str, *, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` if ``module`` cannot be imported (checked without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{feature} needs {module}, which is not installed: pip install 'atom-kv[{extra}]'")
