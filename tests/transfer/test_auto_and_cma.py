"""Backend-specific behaviour: auto's routing and its fallback to tcp, cma's
kernel-facing pieces and its grant endpoint under silent connections."""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, TransferBackend, TransferError, create_backend
from atom_kv.transfer.cma.syscalls import CmaSys, PeerGone, cma_unavailable_reason, refusal_message
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
    with pytest.raises(TransferError, match=r"process_vm_readv failed: .*\(EFAULT\)"):  # errno by name, not libc's text
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
    from atom_kv.transfer import _grant

    with create_backend("cma", _cfg()) as a, create_backend("cma", _cfg()) as b:
        buf = np.zeros(4096, dtype=np.uint8)
        a.register_memory(buf.ctypes.data, 4096)
        bad = wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=[wire.RegionSpan(region, buf.ctypes.data, 4096)])
        monkeypatch.setattr(_grant, "request_grant", lambda *args, **kwargs: bad)
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


# -- the grant endpoint under silent connections, and auto's fallback -------------
def _grant_cfg(**extra: object) -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_consumer", transfer_timeout_s=2, handshake_timeout_s=2, **extra)


def _served(name: str, cfg: KVTransferConfig, buf: np.ndarray) -> TransferBackend:
    be = create_backend(name, cfg, key=f"served-{name}")
    be.register_memory(buf.ctypes.data, buf.nbytes, align=4096)
    return be


@needs_cma
def test_cma_grant_is_served_in_time_despite_three_silent_connections() -> None:
    from tests.transfer._raw import closed_by_peer

    src = np.arange(1 << 14, dtype=np.uint32).view(np.uint8)
    cfg = _grant_cfg(cma={"grant_timeout_s": 2.0})
    with _served("cma", cfg, src) as a, create_backend("cma", cfg, key="reader") as b:
        desc = wire.decode(a.export_descriptor(), wire.CmaDescriptor)
        silent = [socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=5) for _ in range(3)]
        try:
            t0 = time.monotonic()
            peer = b.add_peer(a.export_descriptor())
            assert time.monotonic() - t0 < 1.0, "the grant waited behind silent connections"
            dst = np.zeros_like(src)
            b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
            h = b.read(peer, [ReadOp(0, 0, 0, 0, src.nbytes)], timeout_s=2)
            assert h.wait(4) and h.error is None and np.array_equal(dst, src)
            for s in silent:  # and the silent ones are dropped at their timeout, counted
                assert closed_by_peer(s, 5)
        finally:
            for s in silent:
                s.close()
        stats = a.stats()
        assert stats["granted"] == 1 and stats["timeout"] == 3


def _auto_pair(cfg: KVTransferConfig, src: np.ndarray, dst: np.ndarray):
    a = _served("auto", cfg, src)
    b = create_backend("auto", cfg, key="reader")
    b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
    return a, b


def _read_all(b: TransferBackend, peer: str, src: np.ndarray, dst: np.ndarray) -> None:
    dst[:] = 0
    h = b.read(peer, [ReadOp(0, 0, 0, 0, src.nbytes)], timeout_s=2)
    assert h.wait(4) and h.error is None, h.error
    assert np.array_equal(dst, src)


@needs_cma
def test_auto_falls_back_to_tcp_when_the_grant_endpoint_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    src = np.arange(1 << 14, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    a, b = _auto_pair(_grant_cfg(cma={"grant_timeout_s": 0.5}), src, dst)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never says a word
    try:
        desc = wire.decode(a.export_descriptor(), wire.AutoDescriptor)
        cma = wire.decode(desc.cma, wire.CmaDescriptor)
        cma.ctl_port = silent.getsockname()[1]
        desc.cma = wire.encode(cma)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="atom_kv.transfer"):
            peer = b.add_peer(wire.encode(desc))
        assert time.monotonic() - t0 < 2.5
        assert b.backend_for(peer) == "tcp"  # type: ignore[attr-defined]
        _read_all(b, peer, src, dst)
        assert b.stats()["cma_fallbacks"] == 1
        assert any("falling back to tcp" in r.getMessage() and "did not answer" in r.getMessage()
                   for r in caplog.records)
    finally:
        silent.close()
        b.close()
        a.close()


@needs_cma
def test_auto_falls_back_to_tcp_when_the_grant_is_refused(monkeypatch) -> None:
    """An idle stranger no longer takes the only slot (fair shares close its connection for the reader's);
    the endpoint refuses when every slot is being answered, which this test stands in for."""
    from atom_kv.transfer.cma import CmaBackend

    src = np.arange(1 << 14, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    a, b = _auto_pair(_grant_cfg(cma={"grant_max_connections": 1, "grant_timeout_s": 5}), src, dst)
    try:
        blob = a.export_descriptor()
        endpoint = next(be for be in a._inner() if isinstance(be, CmaBackend))._serving()._server

        def every_slot_answered(source, peer):
            why = "1 connections already open (cma.grant_max_connections); try again later"
            endpoint.events.warn("busy", f"refused a connection from {peer}: {why}")
            return why, False

        monkeypatch.setattr(endpoint, "_admit", every_slot_answered)
        peer = b.add_peer(blob)
        assert b.backend_for(peer) == "tcp"  # type: ignore[attr-defined]
        _read_all(b, peer, src, dst)
        assert b.stats()["cma_fallbacks"] == 1 and a.stats()["cma_busy"] == 1
    finally:
        b.close()
        a.close()


@needs_cma
def test_auto_routes_by_the_peers_memory_kind() -> None:
    """A same-host peer whose KV cache is in GPU memory is not a cma peer: staged tcp."""
    src = np.arange(1 << 14, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    with create_backend("auto", _cfg()) as a, create_backend("auto", _cfg()) as b:
        a.register_memory(src.ctypes.data, src.nbytes, align=4096)
        b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
        desc = wire.decode(a.export_descriptor(), wire.AutoDescriptor)
        assert desc.memory == ["host"] and desc.cma and not desc.gpu_ipc
        assert b.backend_for(b.add_peer(wire.encode(desc))) == "cma"  # type: ignore[attr-defined]
        desc.memory = ["gpu:0"]  # stand-in: the peer says its memory is on a GPU
        assert b.backend_for(b.add_peer(wire.encode(desc))) == "tcp"  # type: ignore[attr-defined]
