"""Backend-specific behaviour: auto's routing, cma's kernel-facing pieces."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, TransferError, create_backend
from atom_kv.transfer._cma_sys import CmaSys, PeerGone, cma_unavailable_reason, refusal_message
from atom_kv.transfer._hostid import host_identity

CMA_REASON = cma_unavailable_reason()
needs_cma = pytest.mark.skipif(CMA_REASON is not None, reason=CMA_REASON or "")


def _cfg() -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_consumer", transfer_timeout_s=2, handshake_timeout_s=2)


def test_refusal_message_names_tcp() -> None:
    for err in (errno.EPERM, errno.EACCES):
        msg = refusal_message(err)
        assert msg.startswith("cma: the kernel refused process_vm_readv") and "use backend 'tcp'" in msg


def test_host_identity_is_stable_and_specific() -> None:
    hid = host_identity()
    assert hid == host_identity() and hid.count("/") == 2


@needs_cma
def test_cma_partial_read_then_fault_is_reported() -> None:
    sys_ = CmaSys()
    src = np.arange(8192, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    local = np.array([dst.ctypes.data, dst.ctypes.data + 4096], dtype=np.uint64)
    remote = np.array([src.ctypes.data, 4096], dtype=np.uint64)  # second range: unmapped page
    with pytest.raises(TransferError, match="Bad address"):
        sys_.read(os.getpid(), local, remote, np.array([4096, 4096], dtype=np.uint64))
    assert np.array_equal(dst[:4096], src[:4096])  # the part before the fault arrived


@needs_cma
def test_cma_dead_pid_is_peer_gone() -> None:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(PeerGone, match="gone"):
        CmaSys().read(p.pid, np.array([dst.ctypes.data], np.uint64), np.array([4096], np.uint64), np.array([16], np.uint64))


@needs_cma
def test_cma_refuses_peer_on_other_host() -> None:
    with create_backend("cma", _cfg()) as a, create_backend("cma", _cfg()) as b:
        buf = np.zeros(4096, dtype=np.uint8)
        a.register_memory(buf.ctypes.data, 4096)
        desc = wire.decode(a.export_descriptor(), wire.CmaDescriptor)
        desc.host_id = "elsewhere/boot/1"
        with pytest.raises(TransferError, match="another host.*'tcp'"):
            b.add_peer(wire.encode(desc))


@needs_cma
@pytest.mark.parametrize("region", [-1, 1, 10**12])
def test_cma_rejects_a_malformed_grant(monkeypatch: pytest.MonkeyPatch, region: int) -> None:
    import atom_kv.transfer.cma as cma

    with create_backend("cma", _cfg()) as a, create_backend("cma", _cfg()) as b:
        buf = np.zeros(4096, dtype=np.uint8)
        a.register_memory(buf.ctypes.data, 4096)
        bad = wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=[wire.RegionSpan(region, buf.ctypes.data, 4096)])
        monkeypatch.setattr(cma, "request_grant", lambda *args: bad)
        with pytest.raises(TransferError, match="invalid region table"):
            b.add_peer(a.export_descriptor())


@needs_cma
def test_auto_uses_cma_on_this_host_and_tcp_otherwise() -> None:
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    with create_backend("auto", _cfg()) as a, create_backend("auto", _cfg()) as b:
        a.register_memory(src.ctypes.data, src.nbytes, align=4096)
        b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
        blob = a.export_descriptor()
        same = b.add_peer(blob)
        assert b.backend_for(same) == "cma"  # type: ignore[attr-defined]
        desc = wire.decode(blob, wire.AutoDescriptor)
        desc.host_id = "elsewhere/boot/1"
        remote = b.add_peer(wire.encode(desc))
        assert b.backend_for(remote) == "tcp"  # type: ignore[attr-defined]
        for peer, (lo, ro) in ((same, (0, 4096)), (remote, (8192, 16384))):
            h = b.read(peer, [ReadOp(0, lo, 0, ro, 4096)], timeout_s=2)
            assert h.wait(3) and h.error is None, h.error
            assert np.array_equal(dst[lo : lo + 4096], src[ro : ro + 4096])
        b.remove_peer(same)
        h = b.read(same, [ReadOp(0, 0, 0, 0, 16)], timeout_s=2)
        assert h.wait(1) and h.error and "unknown peer" in h.error


def test_bad_descriptors_are_one_line_errors() -> None:
    for name in ("tcp", "auto") + (("cma",) if CMA_REASON is None else ()):
        with create_backend(name, _cfg()) as be:
            with pytest.raises(TransferError, match="bad peer descriptor"):
                be.add_peer(b"\x93garbage")


def test_backends_build_without_a_config() -> None:
    for name in ("tcp", "auto") + (("cma",) if CMA_REASON is None else ()):
        with create_backend(name, None) as be:
            buf = np.zeros(4096, dtype=np.uint8)
            assert be.register_memory(buf.ctypes.data, 4096) == [0]
            assert be.export_descriptor()
