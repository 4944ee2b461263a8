"""Identity of "this host as the kernel sees it", to decide whether a peer
can be read with process_vm_readv (same kernel boot, same pid namespace)."""

from __future__ import annotations

import os
import socket


def host_identity() -> str:
    """``hostname/boot_id/pid-namespace``; equal only for processes that
    share a kernel boot and a pid namespace (so a pid means the same process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "unknown-pidns"
    return f"{socket.gethostname()}/{boot}/{pidns}"
