"""The engine's registration pinger: rank 0 tells every proxy it exists.

Every ``ping_interval_s`` it sends ATOM's registration ping
(:class:`~atom_kv.wire.RegisterPing`) from a DEALER socket to each proxy's
ROUTER. ZeroMQ reconnects on its own, so a proxy that starts late or
restarts picks the engine up at the next ping; a small send high-water mark
and non-blocking sends mean pings never pile up or block.

With ``auth_token`` configured, every ping is signed afresh (``ts``, ``nonce``,
``mac``; see :mod:`atom_kv.auth`) so a proxy started with
``--registration-token`` can tell it from a forgery or a replay. The token
itself never leaves the engine.

Each ping asks for an answer (``answers``): the proxy says registered,
refused and why, or stale (:class:`~atom_kv.wire.RegisterAnswer`). The engine
logs the first success once, then each change of state; a proxy that does
not answer within ``registration_answer_timeout_s`` gets one WARNING naming
the likely causes (address, firewall, a proxy listening on loopback only) and
what the socket's monitor saw (:mod:`atom_kv._zmq_watch`): never connected
(the attempt unanswered, or refused), or connected and nothing came back.

An engine pings only once it serves: a pinger built with
``wait_until_serving`` first waits, in its own thread, until the engine's
HTTP address accepts connections (engines that build their connector before
their HTTP server listens: vLLM, ATOM), so a proxy never probes an engine
that is still starting.

An engine that is shutting down calls :meth:`RegistrationPinger.leaving`: its
pings then say ``draining`` (the first at once), and the proxy routes it no
new legs while the ones it has finish; :attr:`RegistrationPinger.left` is set
once a proxy answered one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Literal, Optional, Sequence

import msgspec
import zmq

from atom_kv import wire
from atom_kv._zmq_watch import ConnectionWatch
from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.config import KVTransferConfig, is_port
from atom_kv.wire import REGISTERED, STALE, RegisterAnswer, RegisterPing, WireError

__all__ = ["RegistrationPinger", "build_registration_pinger", "parse_proxy_address"]

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 1.0   # one attempt to reach the engine's own HTTP server
_SERVING_RETRY_S = 0.5     # between attempts while it starts
_SERVING_WARN_AFTER_S = (30.0, 120.0)
_MAX_ANSWER_BYTES = 8192   # a RegisterAnswer with every field at its bound is about 3.2 KiB
_MAX_UNANSWERED = 4        # pings an answer may still be for (older ones were lost with their connection)


def parse_proxy_address(address: str, default_port: int) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"tcp://host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    text = address.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"proxy address {address!r} has no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not is_port(int(port_text), allow_zero=False):
        raise ValueError(f"proxy address {address!r}: port must be 1..65535")
    return host, int(port_text)


SILENT = "silent"  # a link's state while its proxy does not answer


class _ProxyLink:
    """One proxy: its DEALER socket, the socket's monitor and what the engine has heard from it (for the log)."""

    def __init__(self, host: str, port: int, sock: zmq.Socket) -> None:
        self.address = f"{host}:{port}"
        self.sock = sock
        self.watch = ConnectionWatch(sock)
        self.state: Optional[tuple[str, str]] = None  # (status, reason) of the last answer, or (SILENT, "")
        self.registered_once = False
        self.awaiting_since: Optional[float] = None  # when the oldest unanswered ping was sent (or dropped)
        self.unanswered = 0  # pings sent and not answered yet (bounded): an answer beyond them is not read
        self.before_draining = 0  # answers still due to pings sent before the engine started leaving


class RegistrationPinger:
    """Owns the DEALER sockets to the proxies, the thread that pings them and reads their answers.

    It logs the first ``registered`` answer of each proxy once, then each change: a refusal and
    why, a stale ping, no answer within ``answer_timeout_s``, registered again."""

    def __init__(self, ping: RegisterPing, proxies: list[tuple[str, int]], interval_s: float,
                 auth_token: Optional[str] = None, serving_at: Optional[tuple[str, int]] = None,
                 answer_timeout_s: float = 5.0) -> None:
        self.ping = ping if ping.answers else msgspec.structs.replace(ping, answers=True)
        self.serving_at = serving_at  # ping only once this (host, port) accepts connections
        self.proxies = proxies
        self.interval_s = interval_s
        self.answer_timeout_s = answer_timeout_s
        self.sent = 0
        self.dropped = 0
        self.answers = 0
        self.bad_answers = 0
        self._auth_token = auth_token
        self._fields = msgspec.to_builtins(self.ping)
        self._payload = wire.encode(self.ping)
        self._stop = threading.Event()
        self._waker_r, self._waker_w = socket.socketpair()  # close() wakes the thread's poll through it
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._leaving = threading.Event()  # leaving() was called: the thread turns its pings into draining ones
        self.left = threading.Event()  # a proxy answered a draining ping (or there is no thread to send one)

    def leaving(self) -> None:
        """The engine is shutting down: from now on every ping says ``draining`` (the proxy routes it no new
        legs), the first one at once. Thread-safe; wait on :attr:`left` (bounded) for a proxy to have heard it."""
        if self._thread is None or self._closed:
            self.left.set()
            return
        self._leaving.set()
        try:
            self._waker_w.send(b"d")
        except OSError:
            self.left.set()

    def leave(self, timeout_s: float) -> bool:
        """:meth:`leaving`, then wait up to ``timeout_s`` for a proxy to answer it (blocking: not on a loop);
        True if one did."""
        self.leaving()
        return self.left.wait(timeout_s) and self._leaving.is_set()

    def _start_draining(self, links: list[_ProxyLink]) -> None:
        """On the pinger's thread: the ping becomes a draining one (the answers still due to earlier pings
        do not say a proxy heard it)."""
        for link in links:
            link.before_draining = link.unanswered
        self.ping = msgspec.structs.replace(self.ping, draining=True)
        self._fields = msgspec.to_builtins(self.ping)
        self._payload = wire.encode(self.ping)

    def payload(self) -> bytes:
        """The next ping's bytes: signed with a fresh timestamp and nonce when a token is set."""
        if self._auth_token is None:
            return self._payload
        return msgspec.msgpack.encode(sign_fields(self._auth_token, PURPOSE_REGISTER, self._fields))

    def start(self) -> "RegistrationPinger":
        if self._thread is None and not self._closed and self.proxies:
            self._thread = threading.Thread(target=self._run, name=f"atom-kv-pinger-{self.ping.role}{self.ping.index}",
                                            daemon=True)
            self._thread.start()
            logger.info("registering %s engine %s with %s every %.1f s", self.ping.role, self.ping.engine_id,
                        ", ".join(f"{h}:{p}" for h, p in self.proxies), self.interval_s)
        return self

    def _wait_until_serving(self) -> bool:
        """Block (on the stop event, between connection attempts) until ``serving_at`` accepts a
        connection; False if closed first."""
        assert self.serving_at is not None
        host, port = self.serving_at
        waited = 0.0
        while not self._stop.is_set():
            try:
                socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
                return True
            except OSError:
                pass
            if self._stop.wait(_SERVING_RETRY_S):
                return False
            waited += _SERVING_RETRY_S
            if waited in _SERVING_WARN_AFTER_S:
                logger.warning("the engine's HTTP server is still not accepting connections on %s:%d after %.0f s; "
                               "it registers with the proxy once it does (check that http_port is the port it "
                               "serves on and that it listens on %s)", host, port, waited, host)
        return False

    def _run(self) -> None:
        if self.serving_at is not None and not self._wait_until_serving():
            return
        ctx = zmq.Context()
        links: list[_ProxyLink] = []
        try:
            poller = zmq.Poller()
            poller.register(self._waker_r.fileno(), zmq.POLLIN)
            for host, port in self.proxies:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 2)
                sock.setsockopt(zmq.SNDTIMEO, 0)
                sock.setsockopt(zmq.RCVHWM, 16)
                sock.setsockopt(zmq.MAXMSGSIZE, _MAX_ANSWER_BYTES)
                link = _ProxyLink(host, port, sock)  # its monitor first: it sees the first attempt
                links.append(link)
                sock.connect(f"tcp://{host}:{port}")
                poller.register(sock, zmq.POLLIN)
                poller.register(link.watch.monitor, zmq.POLLIN)
            next_ping = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    for link in links:
                        self._send(link, now)
                    next_ping = now + self.interval_s
                deadline = next_ping
                for link in links:
                    if link.awaiting_since is not None and link.state != (SILENT, ""):
                        due = link.awaiting_since + self.answer_timeout_s
                        if now >= due:
                            self._silent(link)
                        else:
                            deadline = min(deadline, due)
                ready = dict(poller.poll(int(max(0.0, deadline - now) * 1000)))
                if self._waker_r.fileno() in ready:
                    self._waker_r.recv(64)
                    if self._leaving.is_set() and not self.ping.draining:
                        self._start_draining(links)
                        next_ping = time.monotonic()  # say it now, not at the next interval
                for link in links:
                    if link.watch.monitor in ready:
                        link.watch.read()
                    if link.sock in ready:
                        self._read_answers(link)
        except zmq.ZMQError as exc:
            logger.error("registration pinger stopped: %s", exc)
        finally:
            self.left.set()  # nothing more is sent: nobody waits on it
            for link in links:
                link.watch.close(link.sock)
                link.sock.close(0)
            ctx.destroy(linger=0)  # also a socket that failed before it became a link

    def _send(self, link: _ProxyLink, now: float) -> None:
        if link.awaiting_since is None:
            link.awaiting_since = now
        try:
            link.sock.send(self.payload(), zmq.NOBLOCK)
            self.sent += 1
            link.unanswered = min(link.unanswered + 1, _MAX_UNANSWERED)
        except zmq.Again:
            self.dropped += 1
            logger.debug("proxy %s not reachable yet; ping dropped", link.address)

    def _read_answers(self, link: _ProxyLink) -> None:
        for _ in range(16):  # at most a queue's worth per wake-up
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if link.unanswered == 0:  # nothing asked: a proxy cannot flood the log with answers
                self.bad_answers += 1
                continue
            link.unanswered -= 1
            try:
                answer = wire.decode(frames[-1], RegisterAnswer)
            except WireError as exc:
                self.bad_answers += 1
                logger.debug("ignoring a bad answer from proxy %s: %s", link.address, exc)
                continue
            self.answers += 1
            link.awaiting_since = None
            if link.before_draining:
                link.before_draining -= 1
            elif self.ping.draining:
                self.left.set()
            self._changed(link, (answer.status, answer.reason), answer.detail)

    def _silent(self, link: _ProxyLink) -> None:
        link.watch.read()  # what the monitor said up to now
        how = link.watch.describe()
        logger.warning("no answer from proxy %s in %g s: %s; check proxy_ip/proxy_ping_port (the proxy's "
                       "--discovery-port), a firewall between this host and the proxy, and that the proxy's discovery "
                       "does not listen on loopback only (--discovery-host); a proxy older than this engine does "
                       "not answer", link.address, self.answer_timeout_s, how)
        link.state = (SILENT, "")

    def _changed(self, link: _ProxyLink, state: tuple[str, str], detail: str) -> None:
        if state == link.state:
            return
        status, reason = state
        what = f"{self.ping.role} engine {self.ping.engine_id} ({self.ping.request_address})"
        if status == REGISTERED and reason:  # registered, but e.g. the proxy cannot reach the engine's URL
            logger.warning("proxy %s registered %s %s", link.address, what, detail)
        elif status == REGISTERED:
            if not link.registered_once:
                logger.info("registered with proxy %s as %s", link.address, what)
            else:
                logger.info("registered with proxy %s again", link.address)
            link.registered_once = True
        elif status == STALE:
            logger.warning("proxy %s refused registration of %s as stale: %s", link.address, what, detail)
        else:
            logger.warning("proxy %s refused registration of %s (%s): %s", link.address, what, reason, detail)
        link.state = state

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._waker_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._waker_r.close()
        self._waker_w.close()


def build_registration_pinger(
    config: KVTransferConfig,
    *,
    role: Literal["P", "D"],
    index: str,
    http_host: str,
    http_port: int,
    tp_size: int,
    dp_size: int = 1,
    engine_id: str,
    model: Optional[str] = None,
    wait_until_serving: bool = False,
    kv_features: Sequence[str] = (),
    kv_events_endpoint: Optional[str] = None,
    kv_events_replay_endpoint: Optional[str] = None,
) -> RegistrationPinger:
    """A pinger for every address in ``config.proxy_ip`` (call ``.start()``; no proxies: a no-op).

    ``wait_until_serving``: its thread pings only once ``http_host:http_port`` accepts connections.
    ``kv_features``: what the connector takes part in, announced in the ping (for engines whose
    ``/health`` cannot say it, e.g. ``"rendezvous"``). ``kv_events_endpoint`` and
    ``kv_events_replay_endpoint``: where proxies subscribe to the engine's KV cache events
    (DP rank 0's; rank N's are on port + N)."""
    if role not in ("P", "D"):
        raise ValueError(f"role must be 'P' or 'D', got {role!r}")
    proxies = [parse_proxy_address(a, config.proxy_ping_port) for a in config.proxy_addresses]
    ping = RegisterPing(
        role=role,
        index=str(index),
        request_address=f"http://{http_host}:{http_port}/v1/completions",
        handshake_port=config.handshake_port,
        dp_size=dp_size,
        tp_size=tp_size,
        transfer_mode="read",
        engine_id=engine_id,
        model=model,
        kv_features=list(kv_features) or None,
        answers=True,
        kv_events=kv_events_endpoint,
        kv_events_replay=kv_events_replay_endpoint,
    )
    return RegistrationPinger(ping, proxies, config.ping_interval_s, auth_token=config.auth_token,
                              serving_at=(http_host, http_port) if wait_until_serving else None,
                              answer_timeout_s=config.registration_answer_timeout_s)
