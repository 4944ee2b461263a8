"""FAKE mori.io engine for tests: host-memory stand-in, no RDMA.

Semantics kept from MORI-IO: transfers are asynchronous (a worker thread
completes them, so ``InProgress()`` is observable); reads are one-sided and
limited to the registered region (an out-of-range remote access fails with
``ERR_RDMA_OP`` like a remote access error would); sessions need both the
local region and the remote engine registered. Everything else (QPs, NICs,
GPU memory) is not modelled: "GPU" memory is treated as host memory.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import os
import queue
import threading
import time
from typing import Any, Optional

_IDLE_EXIT_S = 0.5
_MAGIC = "fake-mori-io"


class BackendType(enum.IntEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3


class MemoryLocationType(enum.IntEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7


class PollCqMode(enum.IntEnum):
    POLLING = 0
    EVENT = 1


class IOEngineConfig:
    """FAKE IOEngineConfig (host, port); unknown attributes are rejected like pybind's."""

    __slots__ = ("host", "port")

    def __init__(self, host: str = "", port: int = 0) -> None:
        self.host = host
        self.port = port


class RdmaBackendConfig:
    """FAKE RdmaBackendConfig with the documented attributes (no others)."""

    __slots__ = (
        "qp_per_transfer",
        "post_batch_size",
        "num_worker_threads",
        "poll_cq_mode",
        "enable_notification",
        "max_send_wr",
        "max_cqe_num",
        "max_msg_sge",
    )

    def __init__(
        self,
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: PollCqMode = PollCqMode.POLLING,
        enable_notification: bool = True,
    ) -> None:
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = poll_cq_mode
        self.enable_notification = enable_notification
        self.max_send_wr = 0
        self.max_cqe_num = 0
        self.max_msg_sge = 0


class XgmiBackendConfig:
    """FAKE XgmiBackendConfig."""

    __slots__ = ("num_streams", "num_events")

    def __init__(self, num_streams: int = 64, num_events: int = 64) -> None:
        self.num_streams = num_streams
        self.num_events = num_events


class EngineDesc:
    """FAKE EngineDesc: key, host, port and the owner pid (for process_vm_readv)."""

    def __init__(self, key: str, host: str, port: int, pid: int) -> None:
        self.key, self.host, self.port, self.pid = key, host, port, pid

    def pack(self) -> bytes:
        return json.dumps({"m": _MAGIC, "key": self.key, "host": self.host, "port": self.port, "pid": self.pid}).encode()

    @staticmethod
    def unpack(data: bytes) -> "EngineDesc":
        d = _unpack(data)
        return EngineDesc(d["key"], d["host"], d["port"], d["pid"])


class MemoryDesc:
    """FAKE MemoryDesc: owner engine key, id, address, size, owner pid, location."""

    def __init__(self, engine_key: str, id: int, addr: int, size: int, pid: int, device_id: int, loc: int) -> None:
        self.engine_key, self.id, self.addr, self.size = engine_key, id, addr, size
        self.pid, self.device_id, self.loc = pid, device_id, loc

    def pack(self) -> bytes:
        return json.dumps(
            {"m": _MAGIC, "engine_key": self.engine_key, "id": self.id, "addr": self.addr, "size": self.size,
             "pid": self.pid, "device_id": self.device_id, "loc": int(self.loc)}
        ).encode()

    @staticmethod
    def unpack(data: bytes) -> "MemoryDesc":
        d = _unpack(data)
        return MemoryDesc(d["engine_key"], d["id"], d["addr"], d["size"], d["pid"], d["device_id"], d["loc"])


def _unpack(data: bytes) -> dict[str, Any]:
    try:
        d = json.loads(bytes(data))
    except ValueError as exc:
        raise ValueError(f"fake mori: cannot unpack descriptor: {exc}") from None
    if not isinstance(d, dict) or d.get("m") != _MAGIC:
        raise ValueError("fake mori: not a packed fake-mori descriptor")
    return d


class TransferStatus:
    """FAKE TransferStatus: InProgress/Succeeded/Failed/Code/Message/Wait."""

    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._message = ""
        self._done = threading.Event()

    def _set(self, code: StatusCode, message: str = "") -> None:
        self._message = message
        self._code = code
        if code not in (StatusCode.INIT, StatusCode.IN_PROGRESS):
            self._done.set()

    def Code(self) -> StatusCode:
        return self._code

    def Message(self) -> str:
        return self._message

    def InProgress(self) -> bool:
        return self._code == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._code == StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self._code > StatusCode.IN_PROGRESS

    def Wait(self) -> None:
        self._done.wait()


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _copy_from(pid: int, remote_addr: int, local_addr: int, size: int) -> None:
    """Copy ``size`` bytes from ``pid``'s ``remote_addr``; OSError on failure."""
    if pid == os.getpid():
        ctypes.memmove(local_addr, remote_addr, size)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    done = 0
    while done < size:
        local = _IOVec(local_addr + done, size - done)
        remote = _IOVec(remote_addr + done, size - done)
        n = readv(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else 0
            raise OSError(err, os.strerror(err) if err else "short read")
        done += n


class IOEngineSession:
    """FAKE session bound to one local and one remote MemoryDesc."""

    def __init__(self, engine: "IOEngine", local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine, self.local, self.remote = engine, local, remote
        self._uids = itertools.count(1)

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def batch_read(self, local_offsets: list[int], remote_offsets: list[int], sizes: list[int], uid: int) -> TransferStatus:
        status = TransferStatus()
        if not len(local_offsets) == len(remote_offsets) == len(sizes):
            status._set(StatusCode.ERR_INVALID_ARGS, "offset and size lists differ in length")
            return status
        status._set(StatusCode.IN_PROGRESS)
        self._engine._submit(self, list(zip(local_offsets, remote_offsets, sizes)), status)
        return status

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], uid)

    def alive(self) -> bool:
        return self._engine._remote_registered(self.remote.engine_key)


class IOEngine:
    """FAKE IOEngine over host memory; one worker thread completes transfers.

    Fake-only helpers: :meth:`fake_fail_next`, :meth:`fake_hang_next`,
    :meth:`fake_set_delay`, and the :attr:`fake_backends`,
    :attr:`fake_sessions_created`, :attr:`fake_batch_reads` counters.
    """

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self.config = config
        self._lock = threading.Lock()
        self._mems: dict[int, MemoryDesc] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._mem_ids = itertools.count(1)
        self._uids = itertools.count(1)
        self._queue: "queue.Queue[tuple[IOEngineSession, list[tuple[int, int, int]], TransferStatus]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._fail: list[tuple[StatusCode, str]] = []
        self._hang = int(os.environ.get("FAKE_MORI_IO_HANG_NEXT", "0") or 0)
        self._delay_s = float(os.environ.get("FAKE_MORI_IO_DELAY_MS", "0") or 0) / 1000.0
        self.fail_next_from_env = int(os.environ.get("FAKE_MORI_IO_FAIL_NEXT", "0") or 0)
        if self.fail_next_from_env:
            self.fake_fail_next(self.fail_next_from_env)
        self.fake_backends: dict[BackendType, Any] = {}
        self.fake_sessions_created = 0
        self.fake_batch_reads = 0
        self.fake_deregistered_memory = 0
        self.fake_deregistered_engines: list[str] = []

    # -- fake-only controls --------------------------------------------------------
    def fake_fail_next(self, n: int, code: StatusCode = StatusCode.ERR_RDMA_OP, message: str = "") -> None:
        """The next ``n`` transfers fail with ``code`` (default ERR_RDMA_OP)."""
        text = message or "fake injected failure: remote access error on QP"
        with self._lock:
            self._fail.extend([(code, text)] * n)

    def fake_hang_next(self, n: int) -> None:
        """The next ``n`` transfers never complete (stay InProgress)."""
        with self._lock:
            self._hang += n

    def fake_set_delay(self, seconds: float) -> None:
        """Every transfer takes at least ``seconds`` before completing."""
        self._delay_s = seconds

    # -- documented surface -------------------------------------------------------------
    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(self.key, self.config.host, self.config.port, os.getpid())

    def create_backend(self, type: BackendType, config: Any = None) -> None:
        self.fake_backends[BackendType(type)] = config

    def register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes[desc.key] = desc

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes.pop(desc.key, None)
            self.fake_deregistered_engines.append(desc.key)

    def _remote_registered(self, key: str) -> bool:
        with self._lock:
            return key in self._remotes or key == self.key

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        if not isinstance(ptr, int) or ptr <= 0 or size <= 0:
            raise RuntimeError(f"fake mori: bad registration ptr={ptr!r} size={size!r}")
        with self._lock:
            desc = MemoryDesc(self.key, next(self._mem_ids), ptr, size, os.getpid(), device_id, int(mem_loc))
            self._mems[desc.id] = desc
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            if self._mems.pop(desc.id, None) is not None:
                self.fake_deregistered_memory += 1

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> Optional[IOEngineSession]:
        with self._lock:
            if local.engine_key != self.key or local.id not in self._mems:
                return None
            if remote.engine_key not in self._remotes and remote.engine_key != self.key:
                return None
            self.fake_sessions_created += 1
        return IOEngineSession(self, local, remote)

    def batch_read(self, local: MemoryDesc, local_offsets: list[int], remote: MemoryDesc,
                   remote_offsets: list[int], sizes: list[int], uid: int) -> list[TransferStatus]:
        session = self.create_session(local, remote)
        out = []
        for lo, ro, n in zip(local_offsets, remote_offsets, sizes):
            if session is None:
                st = TransferStatus()
                st._set(StatusCode.ERR_NOT_FOUND, "fake mori: memory or remote engine not registered")
            else:
                st = session.batch_read([lo], [ro], [n], uid)
            out.append(st)
        return out

    # -- the worker --------------------------------------------------------------------
    def _submit(self, session: IOEngineSession, ranges: list[tuple[int, int, int]], status: TransferStatus) -> None:
        with self._lock:
            self.fake_batch_reads += 1
            if self._hang > 0:
                self._hang -= 1
                return  # stays IN_PROGRESS forever
            self._queue.put((session, ranges, status))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name=f"fake-mori-io-{self.key}", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            try:
                session, ranges, status = self._queue.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._worker = None
                        return
                continue
            if self._delay_s:
                time.sleep(self._delay_s)
            with self._lock:
                injected = self._fail.pop(0) if self._fail else None
            if injected is not None:
                status._set(*injected)
                continue
            status._set(*self._execute(session, ranges))

    def _execute(self, session: IOEngineSession, ranges: list[tuple[int, int, int]]) -> tuple[StatusCode, str]:
        local, remote = session.local, session.remote
        with self._lock:
            if local.id not in self._mems:
                return StatusCode.ERR_NOT_FOUND, "local memory was deregistered"
        if not self._remote_registered(remote.engine_key):
            return StatusCode.ERR_NOT_FOUND, f"remote engine {remote.engine_key} is not registered"
        for lo, ro, n in ranges:
            if lo < 0 or n <= 0 or lo + n > local.size:
                return StatusCode.ERR_INVALID_ARGS, f"local range [{lo}, {lo + n}) outside {local.size}-byte region"
            if ro < 0 or ro + n > remote.size:
                return StatusCode.ERR_RDMA_OP, f"remote access error: [{ro}, {ro + n}) outside {remote.size}-byte region"
            try:
                _copy_from(remote.pid, remote.addr + ro, local.addr + lo, n)
            except OSError as exc:
                return StatusCode.ERR_RDMA_OP, f"remote read failed: {exc.strerror or exc}"
        return StatusCode.SUCCESS, ""
