"""Memory kinds: read off the tensor, and refused by a backend that cannot
serve them before the tensor's pointer is ever used."""

from __future__ import annotations

import pytest
import torch

from atom_kv.transfer import UnsupportedMemory, create_backend
from atom_kv.transfer.memory import HOST, MemoryKind, gpu, memory_of


class _FakeDevice:
    """A stand-in for ``torch.device('cuda', n)``: no GPU is needed to prove the check runs first."""

    def __init__(self, type_: str, index: int | None) -> None:
        self.type, self.index = type_, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class _FakeGpuTensor:
    """Reports a CUDA device; its ``data_ptr`` fails the test if anybody takes it."""

    def __init__(self, index: int | None = 1) -> None:
        self.device = _FakeDevice("cuda", index)

    def data_ptr(self) -> int:
        raise AssertionError("the pointer of GPU memory was taken before its kind was checked")


def test_memory_of_reads_the_device_not_the_pointer():
    assert memory_of(torch.zeros(4)) == HOST
    assert memory_of(bytearray(4)) == HOST
    assert memory_of(_FakeGpuTensor(2)) == gpu(2)
    assert memory_of(_FakeGpuTensor(None)) == gpu(0)


def test_memory_of_refuses_other_devices():
    class Meta:
        device = _FakeDevice("meta", None)

    with pytest.raises(UnsupportedMemory, match="neither host nor GPU"):
        memory_of(Meta())


@pytest.mark.parametrize("label", ["host", "gpu:0", "gpu:7"])
def test_label_round_trip(label):
    assert MemoryKind.parse(label).label == label


@pytest.mark.parametrize("label", ["", "gpu", "gpu:-1", "cuda:0", "GPU:0"])
def test_bad_labels_name_the_allowed_forms(label):
    with pytest.raises(ValueError, match="allowed: 'host' or 'gpu:N'"):
        MemoryKind.parse(label)


@pytest.mark.parametrize("name", ["cma"])
def test_host_only_backend_refuses_gpu_memory_in_one_line(name):
    be = create_backend(name, key=f"kinds-{name}")
    try:
        with pytest.raises(UnsupportedMemory) as info:
            be.register_memory(0xDEAD0000, 4096, memory=memory_of(_FakeGpuTensor(1)))
        msg = str(info.value)
        assert "\n" not in msg
        assert f"'{name}'" in msg and "gpu:1" in msg and "use backend" in msg
    finally:
        be.close()


def test_tcp_and_auto_take_gpu_memory_kinds():
    """tcp stages GPU memory, auto routes it: neither refuses the kind."""
    for name in ("tcp", "auto"):
        be = create_backend(name, key=f"kinds-{name}")
        try:
            be.check_memory(gpu(0))
            be.check_memory(HOST)
        finally:
            be.close()


def test_gpu_ipc_without_a_gpu_is_unavailable_in_one_line():
    from atom_kv.transfer.memory import gpu_unavailable_reason
    from atom_kv.transfer import BackendUnavailable

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is visible here: gpu_ipc is available")
    with pytest.raises(BackendUnavailable) as info:
        create_backend("gpu_ipc", key="kinds-gpu_ipc")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("gpu_ipc: no GPU visible to torch") and "'tcp'" in msg


def test_gpu_ipc_refuses_host_memory_before_any_pointer(monkeypatch):
    """The refusal runs in check_memory, before the constructor's GPU probe matters."""
    from atom_kv.transfer.gpu_ipc import GpuIpcBackend

    be = GpuIpcBackend.__new__(GpuIpcBackend)  # no GPU here: only the kind check is exercised
    with pytest.raises(UnsupportedMemory, match="'gpu_ipc' cannot serve host memory .*'cma' or 'tcp'"):
        be.check_memory(HOST)


def test_connector_checks_the_kind_before_the_pointer():
    """``register_kv_tensors`` (what every engine adapter calls with its own
    tensors) refuses GPU memory for a host-only backend without touching the pointer."""
    from atom_kv.connector.kv_caches import KVTensor, register_kv_tensors

    class _Tensor(_FakeGpuTensor):
        def numel(self) -> int:
            return 4096

        def element_size(self) -> int:
            return 1

    be = create_backend("cma", key="kinds-connector")
    try:
        with pytest.raises(UnsupportedMemory, match="'cma' cannot serve gpu:3 memory"):
            register_kv_tensors(be, [KVTensor(0, "k", _Tensor(3), 1024, 4)])
    finally:
        be.close()


def test_reference_engine_refuses_cuda_without_a_gpu_in_one_line():
    import subprocess
    import sys

    from atom_kv.transfer.memory import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is visible here")
    for module in ("atom_kv.reference", "atom_kv.demo"):
        out = subprocess.run([sys.executable, "-m", module, "--device", "cuda"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2
        assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: --device cuda: no GPU")
