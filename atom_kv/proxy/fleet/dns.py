"""DNS discovery: ``--prefill-dns NAME:PORT[,HANDSHAKE_PORT]`` and ``--decode-dns`` follow a name's A records.

Like Envoy's STRICT_DNS clusters: every ``--dns-interval`` seconds each name is
resolved again, and its addresses are the pool (a Kubernetes headless service,
a Consul name). A new address becomes an engine (source ``dns``) that starts
*pending* and is routed once a health probe reaches it; an address that is
gone is drained (no new legs) and removed once its in-flight legs are done; one
that comes back before that is routed again. A resolution that fails (timeout,
a server error) changes nothing: the last answer stands, and it is logged.

Resolution never blocks the event loop: with ``--dns-server HOST:PORT`` it is
a small A-record query over UDP to that server (:class:`UdpResolver`, on the
loop); without it the system resolver runs in the loop's executor
(:class:`SystemResolver`). Both are bounded by ``--dns-timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Protocol

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.config import is_port
from atom_kv.proxy.fleet.registry import ROLE_NAMES, Drain, Instance, Origin, Registry
from atom_kv.proxy.fleet.static import Role, build_engine

__all__ = ["DnsDiscovery", "DnsError", "DnsTarget", "SystemResolver", "UdpResolver", "parse_dns_server",
           "parse_dns_spec"]

logger = logging.getLogger(__name__)

MAX_ADDRESSES = 256  # A records taken from one answer
_MAX_ANSWER_BYTES = 4096
_TYPE_A, _CLASS_IN = 1, 1


class DnsError(Exception):
    """A name could not be resolved (the reason in one line)."""


@dataclass(frozen=True)
class DnsTarget:
    """One ``--prefill-dns``/``--decode-dns`` value: the name whose A records are engines of ``role``."""

    role: Role
    name: str
    port: int  # the engines' HTTP port
    handshake_port: int | None = None

    def __str__(self) -> str:
        return f"{self.name}:{self.port}"


def _port(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{spec!r}: {what} must be a port number, got {text!r}") from None
    if not is_port(value, allow_zero=False):
        raise ValueError(f"{spec!r}: {what} must be 1..65535, got {value}")
    return value


def parse_dns_spec(role: Role, spec: str) -> DnsTarget:
    """Parse ``NAME:PORT[,HANDSHAKE_PORT]``; ValueError naming what is wrong."""
    head, _, handshake = spec.partition(",")
    name, sep, port = head.strip().rpartition(":")
    if not sep or not name:
        raise ValueError(f"{spec!r}: expected NAME:PORT[,HANDSHAKE_PORT], e.g. decode.llm.svc.cluster.local:8200")
    name = name.rstrip(".")
    if len(name) > 253 or not all(0 < len(label) <= 63 for label in name.split(".")):
        raise ValueError(f"{spec!r}: {name!r} is not a DNS name")
    return DnsTarget(role, name, _port(port, "PORT", spec),
                     _port(handshake.strip(), "HANDSHAKE_PORT", spec) if handshake.strip() else None)


def parse_dns_server(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of ``--dns-server`` (an IPv4 address)."""
    host, sep, port = text.rpartition(":")
    try:
        socket.inet_aton(host)
    except OSError:
        raise ValueError(f"{text!r}: expected IPV4:PORT, e.g. 127.0.0.53:53") from None
    if not sep or host.count(".") != 3:
        raise ValueError(f"{text!r}: expected IPV4:PORT, e.g. 127.0.0.53:53")
    return host, _port(port, "PORT", text)


class Resolver(Protocol):
    async def resolve(self, name: str) -> set[str]:
        """The IPv4 addresses ``name`` has now (empty: none); DnsError when it cannot say."""


class SystemResolver:
    """The host's resolver (``getaddrinfo``, run in the loop's executor), bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def resolve(self, name: str) -> set[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(name, None, family=socket.AF_INET,
                                                            type=socket.SOCK_STREAM), self.timeout_s)
        except asyncio.TimeoutError:
            raise DnsError(f"{name}: no answer from the system resolver in {self.timeout_s:g} s") from None
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return set()  # the name has no address now: every engine behind it is gone
            raise DnsError(f"{name}: {exc.strerror or exc}") from None
        return {str(info[4][0]) for info in infos[:MAX_ADDRESSES]}


def encode_query(query_id: int, name: str) -> bytes:
    """An A/IN query for ``name`` with recursion desired."""
    labels = b"".join(bytes([len(p)]) + p.encode("ascii") for p in name.split(".") if p)
    return struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", _TYPE_A,
                                                                                                  _CLASS_IN)


def _skip_name(data: bytes, at: int) -> int:
    """The offset after the (possibly compressed) name at ``at``; DnsError if it runs past the end."""
    for _ in range(128):  # labels: a name has at most 127
        if at >= len(data):
            raise DnsError("truncated name in the answer")
        length = data[at]
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return at + 2
        if length == 0:
            return at + 1
        at += 1 + length
    raise DnsError("a name in the answer has too many labels")


def decode_answer(data: bytes, query_id: int) -> set[str] | None:
    """The A records of an answer to ``query_id`` (None: not an answer to it); DnsError for a server error
    or a malformed answer. NXDOMAIN and no records are an empty set."""
    if len(data) < 12:
        raise DnsError("an answer shorter than a DNS header")
    ident, flags, qdcount, ancount = struct.unpack_from("!HHHH", data)
    if ident != query_id or not flags & 0x8000:
        return None
    rcode = flags & 0x000F
    if rcode == 3:
        return set()
    if rcode != 0:
        raise DnsError(f"the server answered rcode {rcode}")
    at = 12
    for _ in range(qdcount):
        at = _skip_name(data, at) + 4
    found: set[str] = set()
    for _ in range(ancount):
        at = _skip_name(data, at)
        if at + 10 > len(data):
            raise DnsError("truncated record in the answer")
        rtype, rclass, _ttl, rdlength = struct.unpack_from("!HHIH", data, at)
        at += 10
        if at + rdlength > len(data):
            raise DnsError("truncated record data in the answer")
        if rtype == _TYPE_A and rclass == _CLASS_IN and rdlength == 4 and len(found) < MAX_ADDRESSES:
            found.add(socket.inet_ntoa(data[at:at + 4]))
        at += rdlength
    return found


class _Query(asyncio.DatagramProtocol):
    def __init__(self, query_id: int) -> None:
        self.query_id = query_id
        self.answer: asyncio.Future[set[str]] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        if self.answer.done():
            return
        try:
            found = decode_answer(data[:_MAX_ANSWER_BYTES], self.query_id)
        except DnsError as exc:
            self.answer.set_exception(exc)
            return
        if found is not None:  # else: not ours (a late answer to an earlier query); keep waiting
            self.answer.set_result(found)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(DnsError(f"the server cannot be reached: {exc}"))


class UdpResolver:
    """A-record queries over UDP to one server (``--dns-server``), on the event loop, each bounded by
    ``timeout_s``."""

    def __init__(self, server: tuple[str, int], timeout_s: float) -> None:
        self.server = server
        self.timeout_s = timeout_s

    async def resolve(self, name: str) -> set[str]:
        loop = asyncio.get_running_loop()
        query_id = secrets.randbelow(1 << 16)
        try:
            transport, proto = await loop.create_datagram_endpoint(lambda: _Query(query_id),
                                                                   remote_addr=self.server)
        except OSError as exc:
            raise DnsError(f"{name}: cannot send to {self.server[0]}:{self.server[1]}: {exc.strerror or exc}") \
                from None
        try:
            transport.sendto(encode_query(query_id, name))
            return await asyncio.wait_for(proto.answer, self.timeout_s)
        except asyncio.TimeoutError:
            raise DnsError(f"{name}: no answer from {self.server[0]}:{self.server[1]} in {self.timeout_s:g} s") \
                from None
        finally:
            transport.close()


class DnsDiscovery:
    """Owns the task that resolves every DNS target each ``interval_s`` and keeps the registry's ``dns``
    engines equal to the answers (adding, draining, removing once idle)."""

    def __init__(self, targets: list[DnsTarget], registry: Registry, resolver: Resolver, interval_s: float, *,
                 log_interval_s: float = 10.0) -> None:
        self.targets = targets
        self.registry = registry
        self.resolver = resolver
        self.interval_s = interval_s
        self._found: dict[tuple[Role, str], DnsTarget] = {}  # the engines DNS gave: role, URL -> from which name
        self._task: asyncio.Task | None = None
        self._warn = RateLimitedLog(logger, "DNS discovery problems", interval_s=log_interval_s)
        self.resolutions = 0  # rounds done (every target resolved or failed once)
        self.failed = 0  # resolutions that failed (timed out, a server error, a malformed answer)

    async def start(self) -> None:
        if self._task is None and self.targets:
            self._task = asyncio.create_task(self._run(), name="atom-kv-dns-discovery")
            logger.info("DNS discovery: %s, every %g s", ", ".join(
                f"{ROLE_NAMES[t.role]} {t}" for t in self.targets), self.interval_s)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self.resolve_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep discovering whatever one answer does
                logger.exception("unexpected error in DNS discovery")
            self._warn.flush()
            await asyncio.sleep(self.interval_s)

    async def resolve_once(self) -> None:
        """Resolve every target once and apply the answers; then remove drained engines that are idle."""
        for target in self.targets:
            try:
                addresses = await self.resolver.resolve(target.name)
            except DnsError as exc:
                self.failed += 1
                self._warn.event(target.name, f"DNS discovery of {ROLE_NAMES[target.role]} engines at {target}: "
                                              f"{exc}; keeping the {len(self._mine(target))} engine(s) it had")
                continue
            self._apply(target, addresses)
        self.resolutions += 1
        for key in list(self._found):
            inst = self.registry.get(*key)
            if inst is None or inst.origin is not Origin.DNS:
                del self._found[key]  # removed by the API: found again at the next answer that names it
            elif inst.drain is Drain.DNS and inst.inflight == 0:
                logger.info("removed %s engine %s: gone from DNS and idle", ROLE_NAMES[inst.role], inst.base_url)
                self.registry.remove(inst)
                del self._found[key]

    def _url(self, target: DnsTarget, address: str) -> str:
        return f"http://{address}:{target.port}"

    def _mine(self, target: DnsTarget) -> list[Instance]:
        found = (self.registry.get(*key) for key, t in self._found.items() if t == target)
        return [i for i in found if i is not None and i.origin is Origin.DNS]

    def _apply(self, target: DnsTarget, addresses: set[str]) -> None:
        urls = {self._url(target, a) for a in addresses}
        for inst in self._mine(target):
            if inst.base_url not in urls and inst.drain is None:
                logger.info("draining %s engine %s: %s no longer names it", ROLE_NAMES[inst.role], inst.base_url,
                            target.name)
                self.registry.set_drain(inst, Drain.DNS)
            elif inst.base_url in urls and inst.drain is Drain.DNS:
                logger.info("%s engine %s is back in %s: routed again", ROLE_NAMES[inst.role], inst.base_url,
                            target.name)
                self.registry.set_drain(inst, None)
        for url in sorted(urls):
            existing = self.registry.get(target.role, url)
            if existing is not None:
                continue  # ours already, or known by flag, API or ping: left to its own source
            engine = build_engine(target.role, url, None if target.handshake_port is None
                                  else str(target.handshake_port), {}, f"DNS {target}")
            self.registry.add_static(engine, origin=Origin.DNS)
            self._found[(target.role, url)] = target
            logger.info("found %s engine %s in %s; probing it", ROLE_NAMES[target.role], url, target.name)
