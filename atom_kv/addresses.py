"""An engine's two addresses: the one its listeners bind and the one it
advertises (what peers dial: ``remote_host``, descriptors, the registration
ping). An unspecified address (``0.0.0.0``, ``::``) may be bound, never
advertised: it is refused in one line saying which setting to give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from atom_kv._netaddr import is_unspecified
from atom_kv.config import ConfigError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["check_advertisable", "is_unspecified", "kv_addresses"]


def check_advertisable(host: str, what: str, *, fix: str = "set `advertise_host` to this host's reachable address") -> None:
    """Refuse ``host`` as an address to advertise when it is unspecified (one line naming ``what``)."""
    if is_unspecified(host):
        raise ConfigError(f"{what} {host!r} is an unspecified address, which peers cannot dial and is never "
                          f"advertised; {fix}")


def kv_addresses(config: "KVTransferConfig", host: str, bind_host: Optional[str] = None) -> tuple[str, str]:
    """``(advertise, bind)`` for the connector of an engine whose own address is ``host``
    and whose listeners would bind ``bind_host`` (default ``host``): the config's
    ``advertise_host`` and ``bind_host`` win over them. Raises :class:`ConfigError`
    when the address to advertise is unspecified."""
    advertise = config.advertise_host or host
    bind = config.bind_host or bind_host or host
    check_advertisable(advertise, "kv-transfer-config: the engine's address",
                       fix="set `advertise_host` (or the engine's own advertise setting: vLLM's `host_ip`, "
                           "ATOM_HOST_IP, the reference engine's --advertise-host) to this host's reachable address; "
                           "the listeners may still bind it (`bind_host`)")
    return advertise, bind
