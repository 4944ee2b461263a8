"""atom_kv.auth: MACs bound to a purpose, signed maps, and the bounded replay window."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

from atom_kv.auth import (
    PURPOSE_REGISTER, AuthError, ReplayWindow, canonical, mac, new_nonce, sign_fields, verify_fields, verify_mac,
)


def test_mac_is_hmac_sha256_over_purpose_nul_payload():
    expected = hmac.new(b"tok", b"atom-kv/register/v1\0payload", hashlib.sha256).hexdigest()
    assert mac("tok", PURPOSE_REGISTER, b"payload") == expected == mac(b"tok", PURPOSE_REGISTER, b"payload")
    assert verify_mac("tok", PURPOSE_REGISTER, b"payload", expected)
    assert not verify_mac("tok", "atom-kv/other/v1", b"payload", expected)  # bound to its purpose
    assert not verify_mac("other", PURPOSE_REGISTER, b"payload", expected)
    assert not verify_mac("tok", PURPOSE_REGISTER, b"payload", None)


def test_nonces_are_fresh_hex():
    a, b = new_nonce(), new_nonce()
    assert a != b and len(a) == 32 and int(a, 16) >= 0 and set(a) <= set("0123456789abcdef")


def test_canonical_ignores_key_order_and_the_mac():
    one = {"b": 1, "a": {"y": 2, "x": [1, 2]}, "mac": "zz"}
    two = {"a": {"x": [1, 2], "y": 2}, "b": 1}
    assert canonical(one) == canonical(two)
    assert msgspec.msgpack.decode(canonical(one)) == {"a": {"x": [1, 2], "y": 2}, "b": 1}


def test_signed_fields_verify_once_within_the_window():
    signed = sign_fields("tok", PURPOSE_REGISTER, {"type": "register", "role": "P"}, now=1000.0)
    assert set(signed) == {"type", "role", "ts", "nonce", "mac"} and signed["ts"] == 1000.0
    # what the receiver decodes (any key order, round-tripped through msgpack) still verifies
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(dict(reversed(list(signed.items())))))
    window = ReplayWindow(window_s=30.0)
    verify_fields("tok", PURPOSE_REGISTER, received, window, now=1010.0)
    with pytest.raises(AuthError) as err:
        verify_fields("tok", PURPOSE_REGISTER, received, window, now=1011.0)
    assert err.value.reason == "replay"
    for fields, now, reason in (
        (dict(received, role="D"), 1010.0, "auth"),  # tampered
        ({k: v for k, v in received.items() if k != "mac"}, 1010.0, "auth"),  # unsigned
        (sign_fields("tok", PURPOSE_REGISTER, {"x": 1}, now=1000.0), 1031.0, "stale"),  # too old
        (sign_fields("tok", PURPOSE_REGISTER, {"x": 1}, now=1000.0), 969.0, "stale"),  # from the future
        (sign_fields("nope", PURPOSE_REGISTER, {"x": 1}, now=1000.0), 1000.0, "auth"),  # another token
    ):
        with pytest.raises(AuthError) as err:
            verify_fields("tok", PURPOSE_REGISTER, fields, ReplayWindow(30.0), now=now)
        assert err.value.reason == reason


def test_replay_window_memory_is_bounded():
    window = ReplayWindow(window_s=10.0, max_entries=3)
    for i in range(3):
        window.admit(f"{i:032x}", ts=100.0, now=100.0)
    with pytest.raises(AuthError, match="full"):  # never forgets an unexpired nonce to make room
        window.admit(f"{9:032x}", ts=100.0, now=100.0)
    window.admit(f"{9:032x}", ts=125.0, now=125.0)  # the old ones expired (2 x window later)
    assert len(window) == 1
    with pytest.raises(AuthError, match="nonce"):
        window.admit("short", ts=125.0, now=125.0)
