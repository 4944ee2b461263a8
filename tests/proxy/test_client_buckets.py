"""``--rate-limit``'s token buckets: refill at RPS up to BURST, one per client key, a table of bounded size,
and a key that never holds the bearer token itself."""

from __future__ import annotations

import pytest

from atom_kv.proxy.admission.buckets import ClientBuckets, client_key, parse_rate_limit


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_rps_up_to_burst():
    clock = _Clock()
    buckets = ClientBuckets(2.0, 3, max_clients=8, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # empty: one token in 1/2 s
    clock.now += 0.5
    assert buckets.take("a") == 0.0
    clock.now += 60  # a long idle time refills to BURST, no more
    assert [buckets.take("a") for _ in range(4)][-1] > 0
    assert buckets.take("b") == 0.0  # another client: its own bucket


def test_the_table_is_bounded_whatever_number_of_clients():
    buckets = ClientBuckets(1.0, 1, max_clients=16)
    for i in range(10_000):
        buckets.take(f"addr:10.0.{i // 256}.{i % 256}")
    assert len(buckets) == 16


def test_the_key_is_a_digest_of_the_bearer_token_else_the_address():
    key = client_key("Bearer s3cret-value", "10.0.0.1")
    assert key.startswith("token:") and "s3cret" not in key
    assert key == client_key("bearer  s3cret-value ", "10.0.0.2")  # the same token from elsewhere: the same client
    assert key != client_key("Bearer other", "10.0.0.1")
    assert client_key(None, "10.0.0.1") == client_key("Basic abc", "10.0.0.1") == "addr:10.0.0.1"


@pytest.mark.parametrize(("text", "expected"), [("10", (10.0, 10)), ("0.5", (0.5, 1)), ("5,20", (5.0, 20))])
def test_parse_rate_limit(text, expected):
    assert parse_rate_limit(text) == expected


@pytest.mark.parametrize(("text", "names"), [("", "RPS[,BURST]"), ("x", "RPS[,BURST]"), ("0", "RPS"),
                                             ("-1,5", "RPS"), ("5,0", "BURST"), ("5,x", "RPS[,BURST]"),
                                             ("inf", "RPS")])
def test_parse_rate_limit_refuses_in_our_words(text, names):
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_rate_limit(text)
