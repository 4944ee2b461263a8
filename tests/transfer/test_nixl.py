"""The ``nixl`` backend beyond the shared contract: how reads map onto NIXL
transfers, the one-line refusal without NIXL, the UCX transport hint, and a
process that used NIXL exiting cleanly. Runs against real NIXL (skipped,
with the install line, where it is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import pytest

from atom_kv.testing.listeners import listeners
from atom_kv.testing.ports import free_ephemeral_window, free_port_range
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import BackendUnavailable, ChunkedRegion, create_backend, split_pair
from atom_kv.transfer.nixl import probe as nixl_probe
from atom_kv.transfer.nixl.plan import Regions, UnitLayout, plan_read

BLOCK = 4096
NBLOCKS = 64

needs_nixl = pytest.mark.skipif(bool(nixl_probe.nixl_unavailable_reason()),
                                reason=nixl_probe.nixl_unavailable_reason() or "")


def _pair(**config):
    """A serving and a reading backend in this process, the reader connected."""
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl", "transfer_timeout_s": 5.0, **config})
    src = np.random.default_rng(3).integers(0, 256, NBLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    server = create_backend("nixl", cfg, key="serve")
    reader = create_backend("nixl", cfg, key="read")
    remote = ChunkedRegion(tuple(server.register_memory(src.ctypes.data, src.nbytes, align=BLOCK)), src.nbytes, src.nbytes)
    local = ChunkedRegion(tuple(reader.register_memory(dst.ctypes.data, dst.nbytes, align=BLOCK)), dst.nbytes, dst.nbytes)
    peer = reader.add_peer(server.export_descriptor())
    return server, reader, peer, src, dst, local, remote


@needs_nixl
def test_scattered_blocks_are_one_prepared_transfer_and_unaligned_ranges_one_explicit():
    server, reader, peer, src, dst, local, remote = _pair()
    try:
        perm = np.random.default_rng(5).permutation(NBLOCKS)
        ops = [op for lb, rb in enumerate(perm) for op in split_pair(local, lb * BLOCK, remote, int(rb) * BLOCK, BLOCK)]
        h = reader.read(peer, ops, timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert np.array_equal(dst.reshape(NBLOCKS, BLOCK), src.reshape(NBLOCKS, BLOCK)[perm])
        assert reader.stats() == {"prepped_transfers": 1}  # 64 blocks, one NIXL transfer
        h = reader.read(peer, split_pair(local, 17, remote, 1000, 3 * BLOCK), timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert np.array_equal(dst[17 : 17 + 3 * BLOCK], src[1000 : 1000 + 3 * BLOCK])
        assert reader.stats() == {"prepped_transfers": 1, "transfers": 1}
    finally:
        reader.close()
        server.close()


def test_plan_maps_blocks_to_prepared_rows():
    local = Regions()
    local.add([1 << 20, 2 << 20], [8 * BLOCK, 8 * BLOCK], -1, BLOCK)
    remote = Regions.of([1 << 30], [16 * BLOCK], [-1], BLOCK)
    ll, rl = UnitLayout.build(local, BLOCK), UnitLayout.build(remote, BLOCK)
    # local region 1 block 2 <- remote blocks 5..6; local region 0 block 0 <- remote block 9
    ops = np.array([[1, 2 * BLOCK, 0, 5 * BLOCK, 2 * BLOCK], [0, 0, 0, 9 * BLOCK, BLOCK]], dtype=np.int64)
    (t,) = plan_read(ops, local, remote, ll, rl)
    assert t.prepped and t.nbytes == 3 * BLOCK
    assert t.local_idx.tolist() == [10, 11, 0] and t.remote_idx.tolist() == [5, 6, 9]
    assert ll.rows["DRAM"][10].tolist() == [(2 << 20) + 2 * BLOCK, BLOCK, 0]
    (t,) = plan_read(np.array([[0, 1, 0, 0, BLOCK]], dtype=np.int64), local, remote, ll, rl)
    assert not t.prepped and t.local_rows.tolist() == [[(1 << 20) + 1, BLOCK, 0]]


def test_missing_nixl_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(nixl_probe, "MODULES", ("atom_kv_no_such_nixl._api",))
    with pytest.raises(BackendUnavailable) as info:
        create_backend("nixl", KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl"}))
    message = str(info.value)
    assert "\n" not in message and 'pip install "atom-kv[nixl]"' in message, message


@needs_nixl
def test_ucx_transport_hint_reaches_ucx(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)  # restored when the test ends
    server, reader, peer, src, dst, local, remote = _pair(nixl={"ucx_tls": "tcp"})
    try:
        assert os.environ.get("UCX_TLS") == "tcp"
        h = reader.read(peer, split_pair(local, 0, remote, 0, NBLOCKS * BLOCK), timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert np.array_equal(dst, src)
    finally:
        reader.close()
        server.close()


def test_unknown_plugin_is_refused_in_one_line():
    if nixl_probe.nixl_unavailable_reason():
        pytest.skip(nixl_probe.nixl_unavailable_reason())
    with pytest.raises(BackendUnavailable, match="NO_SUCH_PLUGIN") as info:
        create_backend("nixl", KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl", "nixl": {"plugins": ["NO_SUCH_PLUGIN"]}}))
    assert "\n" not in str(info.value)


@needs_nixl
def test_ucx_without_a_usable_device_names_the_variables_to_look_at(monkeypatch):
    """An RDMA port this host lacks (as on an Ethernet host): the refusal is one line naming UCX_NET_DEVICES,
    with its value, and UCX_TLS."""
    monkeypatch.setenv("UCX_NET_DEVICES", "atomkv_no_such_nic0:1")  # restored when the test ends
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(BackendUnavailable) as info:
        create_backend("nixl", KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl"}))
    message = str(info.value)
    assert "\n" not in message and "the NIXL agent did not start" in message
    assert "UCX_NET_DEVICES='atomkv_no_such_nic0:1'" in message and "UCX_TLS unset" in message
    assert "look at UCX_NET_DEVICES" in message and "Choosing UCX_NET_DEVICES" in message


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    from tests.transfer.test_nixl import _pair
    from atom_kv.transfer import split_pair
    server, reader, peer, src, dst, local, remote = _pair()
    h = reader.read(peer, split_pair(local, 0, remote, 0, src.nbytes), timeout_s=5)
    assert h.wait(10) and h.error is None, h.error
    assert (dst == src).all()
    pending = reader.read(peer, split_pair(local, 0, remote, 0, src.nbytes), timeout_s=5)
    if sys.argv[1] == "close":
        reader.close()
        server.close()
    print("read-ok", flush=True)
""")


@needs_nixl
@pytest.mark.parametrize("how", ["close", "no-close"])
def test_a_process_that_used_nixl_exits_with_status_0(how):
    # a read still in flight at exit, closed or not: teardown order must not crash the interpreter
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, how], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert "read-ok" in out.stdout


def _listening_tcp_addresses() -> set[str]:
    """Local addresses this process listens on, IPv4 and IPv6."""
    return {addr for addr, _ in listeners()}


@needs_nixl
def test_a_loopback_backend_listens_on_loopback_only(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)  # restored when the test ends
    before = _listening_tcp_addresses()
    backend = create_backend("nixl", KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl"}), host="127.0.0.1")
    try:
        opened = _listening_tcp_addresses() - before
        assert os.environ.get("UCX_NET_DEVICES") == "lo"
        assert opened <= {"127.0.0.1", "::1"}, opened
    finally:
        backend.close()


@pytest.mark.gpu
def test_auto_reads_gpu_memory_from_another_host_through_nixl():
    from atom_kv import wire
    from atom_kv.transfer.memory import gpu_unavailable_reason
    from tests.transfer._serve import pattern, place

    reason = gpu_unavailable_reason() or nixl_probe.nixl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "auto", "transfer_timeout_s": 5.0})
    server, reader = create_backend("auto", cfg, key="serve"), create_backend("auto", cfg, key="read")
    try:
        src, sptr, smem = place(pattern(NBLOCKS * BLOCK), "cuda")
        dst, dptr, dmem = place(np.zeros(NBLOCKS * BLOCK, dtype=np.uint8), "cuda")
        remote = server.register_memory(sptr, NBLOCKS * BLOCK, align=BLOCK, memory=smem)
        local = reader.register_memory(dptr, NBLOCKS * BLOCK, align=BLOCK, memory=dmem)
        desc = wire.decode(server.export_descriptor(), wire.AutoDescriptor)
        assert desc.nixl, "auto offers no nixl descriptor for GPU memory although NIXL is installed"
        # the same peer as seen from another host: gpu_ipc is out, NIXL comes before staged tcp
        peer = reader.add_peer(wire.encode(msgspec.structs.replace(desc, host_id="another-host")))
        assert reader.backend_for(peer) == "nixl"
        ops = split_pair(ChunkedRegion(tuple(local), NBLOCKS * BLOCK, NBLOCKS * BLOCK), 0,
                         ChunkedRegion(tuple(remote), NBLOCKS * BLOCK, NBLOCKS * BLOCK), 0, NBLOCKS * BLOCK)
        h = reader.read(peer, ops, timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert bool((dst == src).all())
    finally:
        reader.close()
        server.close()


def test_plan_sends_long_merged_ranges_as_explicit_rows():
    local = Regions.of([1 << 20], [64 * BLOCK], [-1], BLOCK)
    remote = Regions.of([1 << 30], [64 * BLOCK], [-1], BLOCK)
    ll, rl = UnitLayout.build(local, BLOCK), UnitLayout.build(remote, BLOCK)
    (t,) = plan_read(np.array([[0, 0, 0, 0, 64 * BLOCK]], dtype=np.int64), local, remote, ll, rl)
    assert not t.prepped and t.remote_rows.tolist() == [[1 << 30, 64 * BLOCK, 0]]  # one row, not 64 indices


def _listening_tcp_ports() -> set[int]:
    """Ports this process listens on (IPv4 and IPv6)."""
    return {port for _, port in listeners()}


@needs_nixl
@pytest.mark.parametrize("where", ["inside", "below"])
def test_ucx_listens_only_inside_the_planned_port_range(monkeypatch, where):
    """Inside the kernel's ephemeral range or wholly below it (docs/nixl.md, "Ports"): UCX takes the range."""
    from atom_kv.ports import rank_ports

    monkeypatch.delenv("UCX_TCP_PORT_RANGE", raising=False)  # both restored when the test ends
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    first = free_ephemeral_window(32) if where == "inside" else free_port_range(32)
    span = f"{first}-{first + 31}"
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", "backend": "nixl", "nixl_ucx_tcp_port_range": span})
    before = _listening_tcp_ports()
    backend = create_backend("nixl", cfg, host="127.0.0.1", ports=rank_ports(cfg))
    try:
        opened = _listening_tcp_ports() - before
        assert os.environ.get("UCX_TCP_PORT_RANGE") == span
        assert opened, "UCX opened no TCP listener"
        assert all(first <= p <= first + 31 for p in opened), (span, opened)
    finally:
        backend.close()


@needs_nixl
def test_close_destroys_the_native_agent_even_while_a_handle_is_still_held():
    # NIXL's handle wrappers reference the native agent: one kept past close (a traceback, a cache)
    # must not keep the agent and UCX's threads alive until some later collection or interpreter exit
    import weakref

    server, reader, peer, src, dst, local, remote = _pair()
    try:
        ops = [op for b in range(0, NBLOCKS, 2) for op in split_pair(local, b * BLOCK, remote, b * BLOCK, BLOCK)]
        h = reader.read(peer, ops, timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        held = list(reader._peers[peer].dlists.values())  # a scattered read prepared this peer's list
        assert held
        native = weakref.ref(reader._agent.native.agent)
        reader.close()
        assert native() is None and all(d._agent is None for d in held)
    finally:
        reader.close()
        server.close()
