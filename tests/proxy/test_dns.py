"""DNS discovery's parts: the spec and server flags, the A-record client's answer decoding (bounds-checked,
never trusting a length), and its timeout against a real UDP socket that never answers."""

from __future__ import annotations

import socket
import struct

import pytest

from atom_kv.proxy.fleet.dns import (DnsError, DnsTarget, UdpResolver, decode_answer, encode_query,
                                     parse_dns_server, parse_dns_spec)


def test_specs_parse_and_errors_name_the_part():
    assert parse_dns_spec("D", "decode.llm.svc:8200,6301") == DnsTarget("D", "decode.llm.svc", 8200, 6301)
    assert parse_dns_spec("P", "prefill.llm.svc.:8100") == DnsTarget("P", "prefill.llm.svc", 8100, None)
    with pytest.raises(ValueError, match="expected NAME:PORT"):
        parse_dns_spec("D", "decode.llm.svc")
    with pytest.raises(ValueError, match="PORT must be 1..65535"):
        parse_dns_spec("D", "decode.llm.svc:0")
    with pytest.raises(ValueError, match="HANDSHAKE_PORT must be a port number"):
        parse_dns_spec("D", "decode.llm.svc:8200,x")
    with pytest.raises(ValueError, match="is not a DNS name"):
        parse_dns_spec("D", "a..b:8200")
    assert parse_dns_server("127.0.0.53:53") == ("127.0.0.53", 53)
    with pytest.raises(ValueError, match="expected IPV4:PORT"):
        parse_dns_server("resolver:53")


def _answer(query_id: int, records: list[bytes], rcode: int = 0, ancount: int | None = None) -> bytes:
    question = encode_query(query_id, "decode.test")[12:]
    head = struct.pack("!HHHHHH", query_id, 0x8180 | rcode, 1, len(records) if ancount is None else ancount, 0, 0)
    return head + question + b"".join(records)


def _a(address: str, rtype: int = 1) -> bytes:
    return b"\xc0\x0c" + struct.pack("!HHIH", rtype, 1, 0, 4) + socket.inet_aton(address)


def test_answers_decode_bounded():
    assert decode_answer(_answer(7, [_a("10.0.0.5"), _a("10.0.0.6"), _a("1.2.3.4", rtype=16)]), 7) == {
        "10.0.0.5", "10.0.0.6"}  # a TXT record's four bytes are no address
    assert decode_answer(_answer(7, [_a("10.0.0.5")]), 8) is None  # another query's answer
    assert decode_answer(encode_query(7, "decode.test"), 7) is None  # a query, not an answer
    assert decode_answer(_answer(7, [], rcode=3), 7) == set()  # NXDOMAIN: nothing there now
    with pytest.raises(DnsError, match="rcode 2"):
        decode_answer(_answer(7, [], rcode=2), 7)
    with pytest.raises(DnsError, match="truncated record"):
        decode_answer(_answer(7, [_a("10.0.0.5")[:-2]]), 7)
    with pytest.raises(DnsError, match="truncated"):
        decode_answer(_answer(7, [], ancount=3), 7)  # says three records, carries none
    with pytest.raises(DnsError, match="shorter than a DNS header"):
        decode_answer(b"\x00\x07", 7)


async def test_a_server_that_never_answers_times_out():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(DnsError, match="no answer from 127.0.0.1:.* in 0.2 s"):
            await UdpResolver(silent.getsockname(), 0.2).resolve("decode.test")
        assert silent.recv(512)[12:] == encode_query(0, "decode.test")[12:]  # it did ask, for that name
    finally:
        silent.close()
