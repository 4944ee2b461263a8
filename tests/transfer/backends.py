"""Registry of backends the transfer contract suite (test_contract.py) runs.

To add a backend, append one ``BackendSpec`` to ``SPECS`` below:

* ``name``      - the pytest id (e.g. "moriio-fake");
* ``backend``   - the name passed to ``atom_kv.transfer.create_backend``;
* ``setup``     - optional "module:function" (no arguments) run first in BOTH
                  the test process and the spawned serving process, e.g. to
                  put a fake library on ``sys.path``; must be importable from
                  the repo root (``tests.transfer...``);
* ``skip_reason`` - optional "module:function" returning ``None`` when the
                  backend can run here, else a one-line reason to skip
                  (only for genuine hardware/library absence);
* ``config``    - extra ``KVTransferConfig`` keys for both sides;
* ``supports_auth`` - whether the backend enforces ``auth_token``;
* ``device``    - "cpu" (host memory), "memfd" (host memory in a memfd, what
                  the gpu_ipc host stand-in shares) or "cuda" (GPU 0 on both
                  sides: such specs carry the ``gpu`` marker and skip without
                  a GPU);
* ``factory``   - optional "module:function" (config, host, key) building the
                  backend instead of ``create_backend`` (the gpu_ipc host
                  stand-in is passed to the backend this way, never by name);
* ``stage_host`` - run the staging path GPU memory takes on host memory
                  (``TcpBackend.stage_host_memory``), both sides.

The suite lowers ``TransferBackend.max_region_bytes`` on both sides (to get
many small chunks) before ``register_memory``; a backend must honour it.

Specs are plain data (picklable): the serving process receives the spec name
and looks it up here again, so an entry needs no other code in the suite.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class BackendSpec:
    """How to build one backend in the test process and in a serving process."""

    name: str
    backend: str
    setup: Optional[str] = None
    skip_reason: Optional[str] = None
    config: dict[str, Any] = field(default_factory=dict)
    supports_auth: bool = True
    device: str = "cpu"
    stage_host: bool = False
    factory: Optional[str] = None

    def create(self, config: Any, *, host: str = "127.0.0.1", key: Optional[str] = None) -> Any:
        """The backend this spec names, on both sides of the suite."""
        if self.factory:
            return _resolve(self.factory)(config, host, key)
        from atom_kv.transfer import create_backend

        return create_backend(self.backend, config, host=host, key=key)

    def prepare(self, backend: Any) -> None:
        """Set what this spec changes on a backend before it registers memory."""
        if self.stage_host:
            backend.stage_host_memory = True

    def run_setup(self) -> None:
        if self.setup:
            _resolve(self.setup)()

    def reason_to_skip(self) -> Optional[str]:
        if not self.skip_reason:
            return None
        self.run_setup()
        return _resolve(self.skip_reason)()


def _resolve(target: str) -> Callable[[], Any]:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def cma_skip_reason() -> Optional[str]:
    """None when process_vm_readv works on this kernel, else why not."""
    from atom_kv.transfer.cma import cma_unavailable_reason

    return cma_unavailable_reason()


def nixl_skip_reason() -> Optional[str]:
    """None when NIXL's Python API loads here, else its one-line install hint."""
    from atom_kv.transfer.nixl.probe import nixl_unavailable_reason

    return nixl_unavailable_reason()


def gpu_skip_reason() -> Optional[str]:
    """None when torch sees a GPU here, else why the GPU specs skip."""
    from atom_kv.transfer.memory import gpu_unavailable_reason

    return gpu_unavailable_reason()


def host_seam_skip_reason() -> Optional[str]:
    """None when the gpu_ipc host stand-in (memfd + pidfd_getfd) works here."""
    from atom_kv.transfer.gpu_ipc.host_seam import HostSeam

    return HostSeam.unavailable_reason()


def gpu_ipc_on_host_seam(config: Any, host: str, key: Optional[str]) -> Any:
    """gpu_ipc over the host STAND-IN of its device seam: the whole backend
    (grant, mapping, bounds, batched copies, completion, close) on host memory."""
    from atom_kv.transfer.gpu_ipc.host_seam import HostSeam
    from atom_kv.transfer.gpu_ipc import GpuIpcBackend

    return GpuIpcBackend(config, host=host, key=key, _seam=HostSeam())


def nixl_gpu_skip_reason() -> Optional[str]:
    """None when NIXL loads and torch sees a GPU here, else why not."""
    return gpu_skip_reason() or nixl_skip_reason()


SPECS: list[BackendSpec] = [
    BackendSpec(name="tcp", backend="tcp"),
    # the staging path of GPU memory, run on host memory through the host copier
    BackendSpec(name="tcp-staged", backend="tcp", stage_host=True),
    BackendSpec(name="cma", backend="cma", skip_reason="tests.transfer.backends:cma_skip_reason"),
    BackendSpec(name="auto", backend="auto"),
    # gpu_ipc's whole logic, between real processes, over the host stand-in of its device seam
    BackendSpec(name="gpu_ipc-hostseam-standin", backend="gpu_ipc", device="memfd",
                factory="tests.transfer.backends:gpu_ipc_on_host_seam",
                skip_reason="tests.transfer.backends:host_seam_skip_reason"),
    # moriio-fake / moriio entries are appended below this line.
    # MORI-IO reads are one-sided (RDMA): there is no serving code to check a token.
    BackendSpec(
        name="moriio-fake",
        backend="moriio",
        setup="tests.transfer.fake_mori:use_fake",  # FAKE mori.io: host memory, no RDMA
        supports_auth=False,
    ),
    BackendSpec(
        name="moriio",
        backend="moriio",
        setup="tests.transfer.fake_mori:use_real",
        skip_reason="tests.transfer.fake_mori:real_moriio_skip_reason",
        supports_auth=False,
    ),
    # real NIXL (UCX over cma/shared memory/TCP on loopback); reads are
    # one-sided, so the token is proven by the connector's handshake only
    BackendSpec(name="nixl", backend="nixl", skip_reason="tests.transfer.backends:nixl_skip_reason", supports_auth=False),
    # GPU memory on both sides (marked `gpu`: `make test-gpu`)
    BackendSpec(name="tcp-cuda", backend="tcp", device="cuda", skip_reason="tests.transfer.backends:gpu_skip_reason"),
    BackendSpec(name="gpu_ipc-cuda", backend="gpu_ipc", device="cuda",
                skip_reason="tests.transfer.backends:gpu_skip_reason"),
    BackendSpec(name="auto-cuda", backend="auto", device="cuda", skip_reason="tests.transfer.backends:gpu_skip_reason"),
    BackendSpec(name="nixl-cuda", backend="nixl", device="cuda", supports_auth=False,
                skip_reason="tests.transfer.backends:nixl_gpu_skip_reason"),
]


#: specs other tests serve through ``tests.transfer._serve`` (not part of the contract suite)
EXTRA_SPECS: list[BackendSpec] = [
    # gpu_ipc on the host stand-in, logging the seam calls (tests/transfer/test_gpu_ipc_host.py)
    BackendSpec(name="gpu_ipc-hostseam-recording", backend="gpu_ipc", device="memfd",
                factory="tests.transfer.test_gpu_ipc_host:recording_backend",
                skip_reason="tests.transfer.backends:host_seam_skip_reason"),
]


def by_name(name: str) -> BackendSpec:
    for spec in SPECS + EXTRA_SPECS:
        if spec.name == name:
            return spec
    raise KeyError(f"no backend spec named {name!r}")
