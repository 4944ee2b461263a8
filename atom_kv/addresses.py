"""An engine's two addresses: the one its listeners bind and the one it
advertises (what peers dial: ``remote_host``, descriptors, the registration
ping). An unspecified address (``0.0.0.0``, ``::``) may be bound, never
advertised: it is refused in one line saying which setting to give. A
listener beyond loopback needs the cluster token (``auth_token``), unless the
operator says ``allow_open_listeners``: without it, whoever reaches the port
may read the engine's KV cache (the same rule covers the reference engine's
KV events endpoint, :mod:`atom_kv.reference.kv_events.config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from atom_kv._netaddr import is_loopback, is_unspecified
from atom_kv.config import ConfigError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["check_advertisable", "check_listeners_secured", "is_unspecified", "kv_addresses"]


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


def check_listeners_secured(config: "KVTransferConfig", bind: str, *,
                            what: str = "kv-transfer-config: the KV listeners",
                            exposes: str = "read this engine's KV cache") -> None:
    """Refuse listeners on ``bind`` beyond loopback without ``auth_token`` (one line naming both keys),
    unless the config says ``allow_open_listeners``. ``what`` names the listeners, ``exposes``
    says what a stranger who reaches them could do (the KV listeners by default; the reference
    engine's KV events endpoint too)."""
    if config.auth_token is not None or config.allow_open_listeners or is_loopback(bind):
        return
    raise ConfigError(f"{what} would bind {bind!r}, beyond loopback, with no "
                      f"`auth_token`: anyone who reaches them could {exposes}; set `auth_token` "
                      "(the same on every engine and as the proxy's --registration-token), or "
                      "`allow_open_listeners: true` on a network only the cluster can reach")
