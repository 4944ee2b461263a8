"""The serving loop shared by the tcp read server and the grant endpoint:
one selector thread multiplexes every connection, a fixed pool of handler
threads answers complete frames.

What it guarantees whatever the peers do:

- **Bounded threads**: 1 selector thread + ``limits.threads`` handlers, however
  many connections are open.
- **Bounded connections, fair shares** (:class:`~atom_kv._fairshare.FairShares`):
  at most ``limits.max_connections``; at most
  ``limits.max_unauthenticated_per_source`` of them may wait for their hello
  from one peer address: one more closes that address's oldest waiting
  connection ("busy_source"), so a stranger sharing a reader's address only
  pushes out its own idle connections. Connections from addresses that never
  authenticated share ``max_connections - limits.reserved``; the rest is kept
  for addresses that authenticated before. Past the share, a newcomer closes
  the oldest waiting connection of the address holding the most, or is sent the
  protocol's refusal frame, naming the cause, and closed ("busy").
- **No allocation before authentication**: until the handler marks a
  connection authenticated, a frame may announce at most
  :data:`HELLO_FRAME_MAX` bytes; afterwards at most ``limits.max_frame``. A
  bigger announcement drops the connection ("oversized") before any buffer
  is allocated for it.
- **Timeouts**: the hello must arrive within ``limits.hello_timeout_s`` of the
  accept, every later frame within ``read_timeout_s`` of its first byte
  ("timeout"), and an authenticated connection with no frame for
  ``limits.idle_timeout_s`` is closed ("idle").

The protocol plugs in three callables: ``greet(conn)`` returns the frame sent
right after accept (the server hello, which may carry a challenge nonce);
``refuse_busy(why)`` the frame that refuses a connection over a limit (``why``
names it); and
``handle(conn, payload)`` runs in a handler thread with the connection to
itself (blocking sends with deadlines are fine there) and returns whether to
keep the connection.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from atom_kv._fairshare import FairShares, ProvenSources
from atom_kv._waker import Waker
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._sockio import FRAME_HEADER, HELLO_FRAME_MAX, frame

__all__ = ["Conn", "FrameServer", "ServerLimits", "listen"]

log = logging.getLogger(__name__)

_ACCEPT_BURST = 64
#: after a failed accept (EMFILE: out of file descriptors) stop accepting this long
_ACCEPT_PAUSE_S = 0.5
_LISTEN = object()
_WAKE = object()


@dataclass(frozen=True)
class ServerLimits:
    """The bounds one :class:`FrameServer` enforces (see the module doc)."""

    max_connections: int
    max_frame: int
    read_timeout_s: float
    idle_timeout_s: float
    threads: int
    hello_timeout_s: Optional[float] = None  # None: read_timeout_s
    max_unauthenticated_per_source: Optional[int] = None  # None: max_connections
    reserved: int = 0  # connections kept for addresses that authenticated before
    #: the config keys that set max_connections, the per-source cap and the reserve (for refusal texts)
    keys: tuple[str, str, str] = ("max_connections", "max_unauthenticated_per_source", "reserved")

    @property
    def hello_s(self) -> float:
        return self.read_timeout_s if self.hello_timeout_s is None else self.hello_timeout_s


class Conn:
    """One accepted connection. The selector thread owns it while it waits for
    a frame; a handler thread owns it while it answers one. ``authenticated``
    and ``nonce`` belong to the protocol."""

    __slots__ = ("cid", "sock", "peer", "authenticated", "nonce", "data", "_header", "_hgot", "_buf", "_bgot",
                 "deadline", "_busy", "source", "_unproven", "_reserved", "_hello")

    def __init__(self, cid: int, sock: socket.socket, peer: str, source: str = "") -> None:
        self.cid = cid
        self.sock = sock
        self.peer = peer
        self.source = source  # the peer's address
        self._unproven = False  # counted among its source's connections waiting for their hello
        self._reserved = False  # ... in the reserve of addresses that authenticated before
        self._hello = False  # a handler judges its hello
        self.authenticated = False
        self.nonce = ""
        #: protocol-specific per-connection state
        self.data: object = None
        self._header = bytearray(FRAME_HEADER.size)
        self._hgot = 0
        self._buf: Optional[bytearray] = None
        self._bgot = 0
        self.deadline = float("inf")
        self._busy = False

    def _reset_frame(self) -> None:
        self._hgot = 0
        self._buf = None
        self._bgot = 0


@dataclass(frozen=True)
class _Io:
    """What :meth:`FrameServer.start` opens: the listening socket, the selector over it and the
    connections, and the waker that interrupts the selector."""

    listener: socket.socket
    selector: selectors.BaseSelector
    waker: Waker


def listen(bind_host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``bind_host`` (IPv4 or IPv6) and ``port`` (0: OS-assigned)."""
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    return socket.create_server((bind_host, port), family=family, backlog=128)


class FrameServer:
    """Owns a listening socket, the selector thread, the handler threads and
    every open connection of one endpoint. ``name`` names the threads
    ("atomkv-tcp-<port>"); ``label`` starts every log line; ``events`` counts."""

    def __init__(
        self,
        name: str,
        label: str,
        bind_host: str,
        limits: ServerLimits,
        events: EndpointEvents,
        *,
        greet: Callable[[Conn], bytes],
        refuse_busy: Callable[[str], bytes],
        handle: Callable[[Conn, bytearray], bool],
        port: int = 0,
    ) -> None:
        self._name = name
        self._label = label
        self._limits = limits
        self.events = events
        self._greet = greet
        self._refuse_busy = refuse_busy
        self._handle = handle
        self._bind_host = bind_host
        #: the port asked for until :meth:`start`, then the one listened on
        self.port: int = port
        self.bind_address: tuple = ()
        self._io: Optional[_Io] = None  # made by start()
        self._lock = threading.Lock()
        self._conns: dict[int, Conn] = {}
        per_source = limits.max_unauthenticated_per_source or limits.max_connections
        self._shares = FairShares(limits.max_connections, per_source, limits.reserved, ProvenSources())
        self._waiting: dict[str, dict[int, Conn]] = {}  # peer address -> its connections waiting for their hello
        self._returned: list[tuple[Conn, bool]] = []
        self._seq = 0
        self._next_check = float("inf")
        self._accept_resume_at: Optional[float] = None
        self._stop = threading.Event()
        self._closed = False
        self._work: "queue.Queue[Optional[tuple[Conn, bytearray]]]" = queue.Queue()
        self._handlers: list[threading.Thread] = []
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "FrameServer":
        """Listen and start the threads (once; raises ``OSError`` when the port cannot be bound)."""
        with self._lock:
            if self._closed or self._thread is not None:
                raise RuntimeError(f"{self._label}: start() runs once, before close()")
            lsock = listen(self._bind_host, self.port)
            lsock.setblocking(False)
            self.port = lsock.getsockname()[1]
            self.bind_address = lsock.getsockname()
            io = self._io = _Io(lsock, selectors.DefaultSelector(), Waker())
            io.selector.register(lsock, selectors.EVENT_READ, _LISTEN)
            io.selector.register(io.waker.fileno(), selectors.EVENT_READ, _WAKE)
            self._handlers = [
                threading.Thread(target=self._handler_loop, name=f"{self._name}-{self.port}-handler-{i}", daemon=True)
                for i in range(self._limits.threads)
            ]
            self._thread = threading.Thread(target=self._selector_loop, name=f"{self._name}-{self.port}-io",
                                            daemon=True)
            for t in self._handlers:
                t.start()
            self._thread.start()
        return self

    @property
    def connections(self) -> int:
        """Connections open right now."""
        with self._lock:
            return len(self._conns)

    # -- selector thread ------------------------------------------------
    def _started(self) -> _Io:
        """The sockets :meth:`start` opened (the selector thread's methods run only after it)."""
        if self._io is None:
            raise RuntimeError(f"{self._label}: the serving loop runs only after start()")
        return self._io

    def _selector_loop(self) -> None:
        io = self._started()
        sel, lsock, waker = io.selector, io.listener, io.waker
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = None if self._next_check == float("inf") else max(0.0, self._next_check - now)
                for key, _ in sel.select(timeout):
                    if self._stop.is_set():
                        break
                    if key.data is _LISTEN:
                        self._accept()
                    elif key.data is _WAKE:
                        waker.drain()
                    else:
                        self._on_readable(key.data)
                self._take_back_returned()
                self._expire(time.monotonic())
        except Exception:  # a bug must not leave the endpoint silently deaf
            log.exception("%s: serving loop failed; closing the endpoint", self._label)
            self._stop.set()
        finally:
            sel.close()
            lsock.close()

    def _arm(self, conn: Conn, deadline: float) -> None:
        conn.deadline = deadline
        if deadline < self._next_check:
            self._next_check = deadline

    def _accept(self) -> None:
        io = self._started()
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = io.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: count, pause accepting (no spinning), keep serving
                self.events.warn("accept", f"{self._label}: accept failed: {exc}; pausing accepts "
                                           f"for {_ACCEPT_PAUSE_S}s")
                io.selector.unregister(io.listener)
                self._accept_resume_at = time.monotonic() + _ACCEPT_PAUSE_S
                self._next_check = min(self._next_check, self._accept_resume_at)
                return
            peer = f"{addr[0]}:{addr[1]}"
            sock.setblocking(False)
            source = str(addr[0])
            why, reserved = self._admit(source, peer)
            if why is not None:
                _send_small(sock, frame(self._refuse_busy(why)))
                sock.close()
                continue
            with self._lock:
                self._seq += 1
                conn = Conn(self._seq, sock, peer, source)
                self._conns[conn.cid] = conn
                self._wait(conn, reserved)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not _send_small(sock, frame(self._greet(conn))):
                self._close(conn)
                continue
            self._arm(conn, time.monotonic() + self._limits.hello_s)
            io.selector.register(sock, selectors.EVENT_READ, conn)

    def _admit(self, source: str, peer: str) -> tuple[Optional[str], bool]:
        """Make room for a connection from ``source`` (closing what the fair shares say), or say why not;
        and whether it counts in the reserve."""
        lim = self._limits
        max_key, source_key, reserve_key = lim.keys
        verdict = self._shares.admit(source)
        if verdict.ok and verdict.evict is not None:
            same = verdict.evict == source
            why = (f"a newer connection came from {source}, which holds the most or {source_key}" if same else
                   f"{source} needs a share and {verdict.evict} holds the most")
            if not self._evict(verdict.evict, "busy_source" if same else "busy", why):
                verdict.ok = False
        if not verdict.ok:
            why = (f"{len(self._shares)} connections from addresses that have not authenticated already wait for "
                   f"their hello (the last {lim.reserved} of {max_key} are kept for readers that authenticated "
                   f"before, {reserve_key}); try again later")
            self.events.warn("busy", f"{self._label}: refused a connection from {peer}: {why}")
            return why, False
        with self._lock:
            full = len(self._conns) >= lim.max_connections
        if full and not self._evict_largest(source):
            why = f"{lim.max_connections} connections already open ({max_key}); try again later"
            self.events.warn("busy", f"{self._label}: refused a connection from {peer}: {why}")
            return why, False
        return None, verdict.reserved

    def _wait(self, conn: Conn, reserved: bool) -> None:
        """``conn`` waits for its hello: counted in its source's share (lock held)."""
        conn._unproven = True
        conn._reserved = reserved
        self._waiting.setdefault(conn.source, {})[conn.cid] = conn
        self._shares.add(conn.source, conn._reserved)

    def _evict(self, source: str, key: str, why: str) -> bool:
        """Close ``source``'s oldest connection still waiting for its hello (not one being answered)."""
        with self._lock:
            victim = next((c for c in self._waiting.get(source, {}).values() if not c._busy), None)
        if victim is None:
            return False
        self._drop(victim, (key, f"{self._label}: closed {victim.peer}, which waited for its hello: {why}"))
        return True

    def _evict_largest(self, source: str) -> bool:
        with self._lock:
            held = len(self._waiting.get(source, {}))
            largest = max(self._waiting, key=lambda s: len(self._waiting[s]), default=None)
            if largest is None or len(self._waiting[largest]) <= held:
                return False
        return self._evict(largest, "busy", f"every connection is taken and {largest} holds the most "
                                            "waiting for their hello")

    def _on_readable(self, conn: Conn) -> None:
        sock = conn.sock
        try:
            while True:
                if conn._buf is None:
                    if conn._hgot == 0 and conn.authenticated:  # a new frame begins: it has read_timeout_s
                        k = sock.recv_into(conn._header)
                        if k:
                            self._arm(conn, time.monotonic() + self._limits.read_timeout_s)
                    else:
                        k = sock.recv_into(memoryview(conn._header)[conn._hgot:])
                    if k == 0:
                        self._drop(conn, None)
                        return
                    conn._hgot += k
                    if conn._hgot < FRAME_HEADER.size:
                        continue
                    (length,) = FRAME_HEADER.unpack(conn._header)
                    limit = self._limits.max_frame if conn.authenticated else HELLO_FRAME_MAX
                    if length > limit:
                        stage = "a request" if conn.authenticated else "its hello (before authenticating)"
                        self._drop(conn, ("oversized", f"{self._label}: dropped {conn.peer}: it announced a "
                                                       f"{length}-byte frame for {stage}; the limit is {limit}"))
                        return
                    conn._buf = bytearray(length)
                    conn._bgot = 0
                    if length == 0:
                        self._dispatch(conn)
                        return
                else:
                    k = sock.recv_into(memoryview(conn._buf)[conn._bgot:])
                    if k == 0:
                        self._drop(conn, None)
                        return
                    conn._bgot += k
                    if conn._bgot == len(conn._buf):
                        self._dispatch(conn)
                        return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, None, f"{exc}")

    def _dispatch(self, conn: Conn) -> None:
        payload = conn._buf
        assert payload is not None
        conn._reset_frame()
        self._started().selector.unregister(conn.sock)
        conn._busy = True
        conn.deadline = float("inf")
        if conn._unproven:  # its hello came: a handler judges it now, it no longer holds a share
            conn._hello = True
            with self._lock:
                self._stop_waiting(conn)
        self._work.put((conn, payload))

    def _take_back_returned(self) -> None:
        with self._lock:
            returned, self._returned = self._returned, []
        sel = self._started().selector
        now = time.monotonic()
        for conn, keep in returned:
            conn._busy = False
            if conn._hello:
                conn._hello = False
                if conn.authenticated:
                    self._shares.proven.proved(conn.source)  # its address is a reader's: the reserve is open to it
                elif keep:
                    with self._lock:
                        self._wait(conn, False)  # the protocol waits for another hello frame
            if not keep or self._stop.is_set():
                self._close(conn)
                continue
            try:
                conn.sock.setblocking(False)
                sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):
                self._close(conn)
                continue
            timeout = self._limits.idle_timeout_s if conn.authenticated else self._limits.hello_s
            self._arm(conn, now + timeout)

    def _expire(self, now: float) -> None:
        if now < self._next_check:
            return
        if self._accept_resume_at is not None and now >= self._accept_resume_at:
            self._accept_resume_at = None
            io = self._started()
            io.selector.register(io.listener, selectors.EVENT_READ, _LISTEN)
        with self._lock:
            waiting = [c for c in self._conns.values() if not c._busy]
        nxt = float("inf")
        for conn in waiting:
            if conn.deadline <= now:
                if not conn.authenticated:
                    self._drop(conn, ("timeout", f"{self._label}: dropped {conn.peer}: no complete hello within "
                                                 f"{self._limits.hello_s:g}s"))
                elif conn._hgot or conn._buf is not None:
                    self._drop(conn, ("timeout", f"{self._label}: dropped {conn.peer}: a request frame did not "
                                                 f"complete within {self._limits.read_timeout_s:g}s"))
                else:
                    self.events.count("idle")
                    log.debug("%s: closed %s: idle for %.0fs", self._label, conn.peer, self._limits.idle_timeout_s)
                    self._drop(conn, None)
            elif conn.deadline < nxt:
                nxt = conn.deadline
        if self._accept_resume_at is not None:
            nxt = min(nxt, self._accept_resume_at)
        self._next_check = nxt

    def _drop(self, conn: Conn, warning: Optional[tuple[str, str]], info: str = "") -> None:
        """Close a connection the selector owns; ``warning`` = (counter key, message)."""
        if warning is not None:
            self.events.warn(*warning)
        elif info:
            log.debug("%s: connection from %s dropped: %s", self._label, conn.peer, info)
        try:
            self._started().selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._close(conn)

    def _stop_waiting(self, conn: Conn) -> None:
        """``conn`` no longer counts toward its source's connections waiting for a hello (lock held): its
        hello came, or it closed."""
        if conn._unproven:
            conn._unproven = False
            mine = self._waiting.get(conn.source)
            if mine is not None:
                mine.pop(conn.cid, None)
                if not mine:
                    del self._waiting[conn.source]
            self._shares.remove(conn.source, conn._reserved)

    def _close(self, conn: Conn) -> None:
        with self._lock:
            self._conns.pop(conn.cid, None)
            self._stop_waiting(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    # -- handler threads ------------------------------------------------
    def _handler_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            conn, payload = item
            keep = False
            if not self._stop.is_set():
                try:
                    keep = self._handle(conn, payload)
                except (OSError, TimeoutError) as exc:
                    log.info("%s: connection from %s dropped while answering: %s", self._label, conn.peer,
                             exc or type(exc).__name__)
                except Exception as exc:  # a bug must drop this connection, not the handler thread
                    # counted and logged rate-limited like any refusal (a peer must not flood the log)
                    self.events.warn("internal", f"{self._label}: unexpected error answering {conn.peer}: "
                                                 f"{type(exc).__name__}: {exc}")
                    log.debug("%s: unexpected error answering %s", self._label, conn.peer, exc_info=True)
            self._give_back(conn, keep)

    def _give_back(self, conn: Conn, keep: bool) -> None:
        with self._lock:
            self._returned.append((conn, keep))
        if self._io is not None:
            self._io.waker.wake()

    # -- lifecycle ------------------------------------------------------
    def close(self) -> None:
        """Stop accepting, stop the threads, close every connection. Idempotent, and safe before
        :meth:`start` (there is nothing to stop then)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, io = self._thread, self._io
        self._stop.set()
        if thread is None or io is None:
            self.events.flush()
            return
        waker = io.waker
        waker.wake()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:  # wakes handlers blocked in a send
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if thread is not threading.current_thread():
            thread.join(timeout=5)
        for _ in self._handlers:
            self._work.put(None)
        for t in self._handlers:
            if t is not threading.current_thread():
                t.join(timeout=5)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._returned.clear()
        for conn in conns:
            try:
                conn.sock.close()
            except OSError:
                pass
        waker.close()
        self.events.flush()


def _send_small(sock: socket.socket, data: bytes) -> bool:
    """Send a small frame on a fresh non-blocking socket; False if it did not all go."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False
