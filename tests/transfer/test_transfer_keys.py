"""The transfer sections: the staging piece and pool sizes reach tcp's
staging, gpu_ipc's grant keys reach its grant endpoint, the cma keys still
set gpu_ipc's (deprecated: one warning line per config), and a bad value is
one line naming the dotted key."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import ConfigError, KVTransferConfig
from atom_kv.transfer import ReadOp, create_backend
from atom_kv.transfer._sockio import HELLO_FRAME_MAX, recv_frame
from atom_kv.transfer.gpu_ipc import GpuIpcBackend
from atom_kv.transfer.gpu_ipc.host_seam import HostSeam, shared_buffer

BLOCK = 4096


def _cfg(**keys: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_consumer", "transfer_timeout_s": 10,
                                       "handshake_timeout_s": 10, **keys})


def _deprecations(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "atom_kv.config" and "deprecated" in r.getMessage()]


def _borrowed(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The lines saying gpu_ipc took the cma keys' values."""
    return [r for r in _deprecations(caplog) if "gpu_ipc's grant endpoint" in r.getMessage()]


def test_the_staging_keys_size_tcp_s_pool_and_a_read_goes_through_many_pieces() -> None:
    piece, pairs = 64 << 10, 3
    cfg = _cfg(staging={"piece_bytes": piece, "pool_pairs": pairs})
    src = (np.arange(1 << 20, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)  # 16 pieces of 64 KiB
    dst = np.zeros_like(src)
    with create_backend("tcp", cfg, key="staged-a") as a, create_backend("tcp", cfg, key="staged-b") as b:
        a.stage_host_memory = b.stage_host_memory = True
        (ra,) = a.register_memory(src.ctypes.data, src.nbytes, align=BLOCK)
        (rb,) = b.register_memory(dst.ctypes.data, dst.nbytes, align=BLOCK)
        for be in (a, b):
            assert (be._regions.pool.nbytes, be._regions.pool.pairs) == (piece, pairs)
        peer = b.add_peer(a.export_descriptor())
        handle = b.read(peer, [ReadOp(rb, 0, ra, 0, src.nbytes)], timeout_s=30)
        assert handle.wait(60) and handle.error is None, handle.error
        assert np.array_equal(src, dst)


def test_the_staging_pool_defaults_to_the_tcp_threads_and_streams() -> None:
    with create_backend("tcp", _cfg(tcp={"server_threads": 2, "streams": 3}), key="staged-default") as be:
        be.stage_host_memory = True
        buf = np.zeros(BLOCK, dtype=np.uint8)
        be.register_memory(buf.ctypes.data, buf.nbytes, align=BLOCK)
        assert (be._regions.pool.nbytes, be._regions.pool.pairs, be._regions.pool.buffers) == (1 << 20, 5, 4)


def _silent_connection_lasts(cfg: KVTransferConfig, bound_s: float) -> float:
    """Seconds a gpu_ipc grant endpoint keeps a connection that never sends its
    request (``bound_s`` when it was still open then)."""
    be = GpuIpcBackend(cfg, key="grant-keys", _seam=HostSeam())
    buf = shared_buffer(BLOCK)
    try:
        be.register_memory(buf.array.ctypes.data, BLOCK, align=BLOCK)
        desc = wire.decode(be.export_descriptor(), wire.CmaDescriptor)
        with socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=bound_s) as sock:
            start = time.monotonic()
            wire.decode(recv_frame(sock, start + bound_s, HELLO_FRAME_MAX), wire.CmaChallenge)
            try:
                closed = sock.recv(1) == b""
            except (TimeoutError, socket.timeout):
                closed = False
            except ConnectionResetError:
                closed = True
            return time.monotonic() - start if closed else bound_s
    finally:
        be.close()
        buf.close_fd()


def test_gpu_ipc_takes_its_own_grant_keys_not_cma_s(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(gpu_ipc={"grant_timeout_s": 0.5, "grant_max_connections": 5}, cma={"grant_timeout_s": 60})
    assert (cfg.gpu_ipc.grant_timeout_s, cfg.gpu_ipc.grant_max_connections) == (0.5, 5)
    assert _silent_connection_lasts(cfg, bound_s=20) < 20  # dropped after 0.5 s, not cma's 60
    assert _deprecations(caplog) == []


@pytest.mark.parametrize("cma, flat_lines", [
    ({"cma": {"grant_timeout_s": 0.5, "grant_max_connections": 7}}, 0),
    ({"cma_grant_timeout_s": 0.5, "cma_grant_max_connections": 7}, 2),  # the flat keys of 0.1: one line each too
])
def test_the_cma_grant_keys_still_set_gpu_ipc_s_with_one_deprecation_line(caplog, cma, flat_lines) -> None:
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = _cfg(**cma)
        assert (cfg.gpu_ipc.grant_timeout_s, cfg.gpu_ipc.grant_max_connections) == (0.5, 7)
        assert _silent_connection_lasts(cfg, bound_s=20) < 20
        _silent_connection_lasts(cfg, bound_s=20)  # a second backend from the same config: no second line
        KVTransferConfig.from_dict(cfg.to_dict())  # nor the config passed on to another process
    (line,) = _borrowed(caplog)
    assert len(_deprecations(caplog)) == 1 + flat_lines
    text = line.getMessage()
    assert "`cma.grant_timeout_s` (0.5)" in text and "`cma.grant_max_connections` (7)" in text
    assert "set `gpu_ipc.grant_timeout_s`, `gpu_ipc.grant_max_connections`" in text and "\n" not in text


@pytest.mark.parametrize("keys", [
    {},  # the defaults
    {"cma": {"grant_timeout_s": 9.0}, "gpu_ipc": {"grant_timeout_s": 2.0}},  # the new key set: the cma one is cma's only
    {"cma": {"grant_timeout_s": 9.0}, "backend": "tcp"},  # gpu_ipc cannot run
])
def test_no_deprecation_line_where_nothing_is_borrowed_or_gpu_ipc_cannot_run(caplog, keys) -> None:
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = _cfg(**keys)
    assert _deprecations(caplog) == []
    assert cfg.gpu_ipc.grant_timeout_s == keys.get("gpu_ipc", keys.get("cma", {"grant_timeout_s": 3.0}))["grant_timeout_s"]


@pytest.mark.parametrize("key, value, allowed", [
    ("gpu_ipc.grant_timeout_s", "soon", "a number"),
    ("gpu_ipc.grant_timeout_s", 0, "a positive number of seconds"),
    ("gpu_ipc.grant_max_connections", 0, ">= 1"),
    ("staging.piece_bytes", 100, "65536..1073741824"),
    ("staging.piece_bytes", 2 << 30, "65536..1073741824"),
    ("staging.pool_pairs", 0, ">= 1"),
])
def test_a_bad_value_is_one_line_naming_the_key(key: str, value: Any, allowed: str) -> None:
    section, name = key.split(".")
    with pytest.raises(ConfigError) as info:
        _cfg(**{section: {name: value}})
    text = str(info.value)
    assert f"`{key}`" in text and allowed in text and "\n" not in text
