"""Engine answers are bounded like client requests (issue 27, item 4): the upstream client against raw
TCP peers that send a huge head, a huge Server-Timing header, or a body over the bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from atom_kv.proxy.http.upstream import AnswerLimits, UpstreamTooLarge
from tests.proxy.test_upstream import RawPeer, _head, pool  # noqa: F401 - pool is a fixture

MiB = 1024 * 1024


def _answer(headers: bytes, body: bytes = b"{}", length: int | None = None):
    async def respond(reader, writer) -> bool:
        n = len(body) if length is None else length
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
                     % (n, headers, body))
        await writer.drain()
        if length is not None:  # announced more than it sends: wait for the client to give up
            await reader.read(1)
            return False
        return True
    return respond


async def test_a_64_mib_server_timing_header_fails_at_the_head_bound_without_being_parsed(pool):  # noqa: F811
    """Today's reproduction: the 64 MiB header took 17 s to parse (quadratic), blocking the loop."""
    peer = await RawPeer(_answer(b"server-timing: " + b"a" * (64 * MiB) + b"\r\n")).start()
    started = time.perf_counter()
    with pytest.raises(UpstreamTooLarge, match=r"--max-upstream-head-bytes \(65536\)"):
        await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=30)
    assert time.perf_counter() - started < 2.0  # failed at 64 KiB, not after reading 64 MiB
    await peer.close()


async def test_many_headers_over_the_head_bound_fail_too(pool):  # noqa: F811
    peer = await RawPeer(_answer(b"".join(b"x-h%d: %b\r\n" % (i, b"v" * 100) for i in range(2000)))).start()
    with pytest.raises(UpstreamTooLarge, match="max-upstream-head-bytes"):
        await pool(limits=AnswerLimits(head=16 * 1024)).request("127.0.0.1", peer.port, _head("/", b"h", 0),
                                                                whole=True, total_timeout=10)
    await peer.close()


async def test_a_server_timing_header_over_its_bound_is_dropped_and_the_answer_kept(pool):  # noqa: F811
    big = b"prefill_queue;dur=1," * 500  # 10 KB: under the head bound, over --max-server-timing-bytes
    for value, kept in ((big, False), (b"prefill_queue;dur=1.5", True)):
        peer = await RawPeer(_answer(b"server-timing: %b\r\nx-other: yes\r\n" % value)).start()
        resp = await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=10)
        assert resp.status == 200 and await resp.read() == b"{}" and resp.header("x-other") == "yes"
        assert ("server-timing" in resp.headers) is kept
        await peer.close()


@pytest.mark.parametrize("cut", [1, 2, 3, 700])
async def test_a_head_in_many_reads_is_parsed_once_whole(pool, cut):  # noqa: F811
    """A head that comes in pieces (its end split too) is collected and parsed in one go."""
    value = b"prefill_queue;dur=1," * 150  # 3 KB, under --max-server-timing-bytes
    head = b"HTTP/1.1 200 OK\r\nserver-timing: " + value + b"\r\ncontent-length: 2\r\n\r\n"

    async def trickle(reader, writer) -> bool:
        split = len(head) - cut  # the last ``cut`` bytes of the head come with the body
        pieces = [head[i:min(i + 500, split)] for i in range(0, split, 500)] + [head[split:] + b"{}"]
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)  # separate reads
        return True

    peer = await RawPeer(trickle).start()
    resp = await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=10)
    assert resp.status == 200 and resp.header("server-timing") == value.decode() and await resp.read() == b"{}"
    await peer.close()


async def test_an_announced_200_mb_body_is_refused_at_once(pool):  # noqa: F811
    peer = await RawPeer(_answer(b"", b"", length=200 * 1000 * 1000)).start()
    started = time.perf_counter()
    with pytest.raises(UpstreamTooLarge, match=r"announced 200000000 bytes, over --max-upstream-body-bytes"):
        await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=30)
    assert time.perf_counter() - started < 2.0  # not after the total timeout
    await peer.close()


async def test_a_small_answer_over_the_bound_in_one_read_fails_instead_of_hanging(pool):  # noqa: F811
    """Head and whole body in one read: the over-bound answer also completed in that feed, which left the
    exchange neither failed nor woken (a whole-answer fetch hung past its total timeout)."""
    peer = await RawPeer(_answer(b"", b"x" * 8192)).start()
    started = time.perf_counter()
    with pytest.raises(UpstreamTooLarge, match=r"announced 8192 bytes, over --max-upstream-body-bytes \(4096\)"):
        await asyncio.wait_for(pool(limits=AnswerLimits(body=4096)).request(
            "127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=30), 10)
    assert time.perf_counter() - started < 2.0
    await peer.close()


async def test_a_body_without_a_length_fails_once_over_the_bound(pool):  # noqa: F811
    async def endless(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        for _ in range(64):  # 4 MiB, delimited by the connection's end
            writer.write(b"x" * (64 * 1024))
            await writer.drain()
        return False

    peer = await RawPeer(endless).start()
    resp = await pool(limits=AnswerLimits(body=MiB)).request("127.0.0.1", peer.port, _head("/", b"h", 0))
    with pytest.raises(UpstreamTooLarge, match=r"sent more than 1048576 bytes, over --max-upstream-body-bytes"):
        await resp.read()
    await peer.close()


async def test_a_streamed_body_is_not_held_so_not_bounded_in_total(pool):  # noqa: F811
    body = b"data: x\n\n" * (300 * 1024)  # 2.6 MiB through a 1 MiB bound
    peer = await RawPeer(_answer(b"", body)).start()
    resp = await pool(limits=AnswerLimits(body=MiB)).request("127.0.0.1", peer.port, _head("/", b"h", 0))
    done = asyncio.get_running_loop().create_future()
    got: list[bytes] = []

    class Consumer:
        def body_received(self, data: bytes) -> None:
            got.append(data)

        def body_complete(self) -> None:
            done.set_result(None)

        def body_failed(self, exc) -> None:
            done.set_exception(exc)

    resp.stream(Consumer())
    await asyncio.wait_for(done, 10)
    assert b"".join(got) == body
    await peer.close()


# ------------------------------------------------------------------ the streamed decode leg's events
def test_a_partial_event_is_held_without_quadratic_copies_and_bounded():
    from atom_kv.proxy.http.sse import EventFramer, EventTooLarge

    framer = EventFramer(max_event_bytes=128 * MiB)
    piece = b"x" * (64 * 1024)
    started = time.perf_counter()
    for _ in range(1024):  # one 64 MiB event, in 64 KiB reads (joined with += this took tens of seconds)
        assert framer.feed_writes(piece, 4) == []
    ((event, ends),) = framer.feed_writes(b"\n\ndata: next", 4)
    assert time.perf_counter() - started < 5.0
    assert len(event) == 64 * MiB + 2 and not ends
    assert framer.flush() == b"data: next"

    small = EventFramer(max_event_bytes=MiB)
    with pytest.raises(EventTooLarge, match="more than 1048576 bytes"):
        for _ in range(17):
            small.feed_writes(piece, 4)


@pytest.mark.parametrize("pieces", [
    [b"data: a\n", b"\ndata: b\n\n"],
    [b"data: a\r\n\r", b"\ndata: b\r\n\r\n"],
    [b"data: a", b"\n", b"\n", b"data: b\n\n"],
])
def test_an_event_end_split_across_reads_is_found(pieces):
    from atom_kv.proxy.http.sse import EventFramer

    framer = EventFramer(max_event_bytes=1024)
    events = [e for p in pieces for e, _ in framer.feed_writes(p, 4)]
    assert [e.strip() for e in events] == [b"data: a", b"data: b"]
