"""A request's ``kv_transfer_params`` are parsed once, at the scheduler's entry: later steps
(the load, every release, the transfer id) take the parsed :class:`RequestParams`, and params
refused for one key still name the producer to release."""

from __future__ import annotations

import msgspec
import pytest

from atom_kv.connector.params import RequestParams
from atom_kv.connector.release import ReleaseSpec
from atom_kv.wire import KVTransferParams
from tests.connector.test_scheduler import consumer, params, producer


class Decodes:
    """Counts every ``msgspec.convert`` into :class:`KVTransferParams` (a parse of a request's params),
    and every other conversion (a key read on its own)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.params = 0
        self.keys = 0
        real = msgspec.convert

        def counting(obj, type_, *args, **kwargs):
            if type_ is KVTransferParams:
                self.params += 1
            else:
                self.keys += 1
            return real(obj, type_, *args, **kwargs)

        monkeypatch.setattr(msgspec, "convert", counting)

    def reset(self) -> None:
        self.params = self.keys = 0


@pytest.fixture
def decodes(monkeypatch) -> Decodes:
    return Decodes(monkeypatch)


def test_a_decode_request_asked_twice_is_parsed_once(decodes):
    """ATOM asks again after its allocation (with the local hit); vLLM asks again while no blocks are free."""
    s = consumer()
    decodes.reset()  # building the scheduler's config converts too
    raw = params(blocks=(5, 6, 7))
    assert s.get_num_new_matched_tokens("d1", 48, raw) == (48, True)
    assert s.get_num_new_matched_tokens("d1", 48, raw, num_computed_tokens=16) == (32, True)
    s.update_state_after_alloc("d1", [1, 2, 3], 32)
    (load,) = s.build_connector_meta().loads
    assert decodes.params == 1 and decodes.keys == 0
    assert (load.block_ids, load.remote_block_ids, load.remote_block_offset) == ([2, 3], [6, 7], 1)
    assert (load.transfer_id, load.remote_host, load.remote_handshake_port) == ("P-r1", "10.0.0.1", 7000)


def test_releases_come_from_the_parsed_params(decodes):
    s = consumer()
    decodes.reset()  # building the scheduler's config converts too
    s.get_num_new_matched_tokens("d1", 40, params(tid="t-ended"))
    s.get_num_new_matched_tokens("d2", 40, params(tid="t-none"))
    s.get_num_new_matched_tokens("d3", 40, params(tid="t-cached"), num_computed_tokens=40)
    assert decodes.params == 3
    decodes.reset()
    s.request_finished("d1", [], aborted=True)
    s.update_state_after_alloc("d2", [1, 2, 3], 0)
    s.request_finished("d3", [])
    assert decodes.params == 0 and decodes.keys == 0  # nothing read the client's dict again
    # a producer this engine never read from: its first rank only (TP rank 0 of DP rank 1)
    assert [spec for spec, _ in s.sent] == [ReleaseSpec(tid, "10.0.0.1", 7002) for tid in ("t-ended", "t-none", "t-cached")]


@pytest.mark.parametrize("change", [{"remote_block_ids": "abc"}, {"remote_engine_id": 7},
                                    {"remote_block_ids": None}])
def test_refused_params_are_parsed_once_and_still_release(decodes, change, caplog):
    s = consumer()
    decodes.reset()  # building the scheduler's config converts too
    assert s.get_num_new_matched_tokens("d1", 40, {**params(), **change}) == (0, False)
    assert decodes.params == 1
    assert [(spec.transfer_id, spec.targets()) for spec, _ in s.sent] == [("P-r1", [("10.0.0.1", 7002)])]
    assert "d1" in caplog.text and "prefilling locally" in caplog.text


def test_a_prefill_request_is_parsed_once_and_its_transfer_id_comes_from_it(decodes):
    s = producer()
    decodes.reset()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "proxy-1"})
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "proxy-1"})  # asked again
    assert decodes.params == 1
    assert s.request_finished("r1", [5])[1]["transfer_id"] == "proxy-1"


def test_the_entry_takes_params_an_engine_parsed(decodes):
    s = consumer()
    decodes.reset()
    parsed = RequestParams.parse(params())
    assert s.get_num_new_matched_tokens("d1", 40, parsed) == (40, True)
    s.request_rejected(RequestParams.parse({**params(tid="t-rej"), "remote_tp_size": 0}))
    assert decodes.params == 2
    assert [spec.transfer_id for spec, _ in s.sent] == []  # a bad remote_tp_size cannot say whom to release
    s.request_rejected(parsed)
    assert [spec.transfer_id for spec, _ in s.sent] == ["P-r1"]


# --- the struct's answers -------------------------------------------------------
def spec_of(raw) -> ReleaseSpec | None:
    return RequestParams.parse(raw).release_spec


def test_release_spec_checks_each_key_on_its_own():
    base = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_handshake_port": 9000}
    assert spec_of(base) == ReleaseSpec("t", "h", 9000)
    assert spec_of({**base, "remote_block_ids": "x", "remote_engine_id": 3}) == ReleaseSpec("t", "h", 9000)
    # unreadable sizes of pipeline and DP: at least the first stage is released
    assert spec_of({**base, "remote_pp_size": "x", "remote_dp_size": 0}) == ReleaseSpec("t", "h", 9000)
    # the first given of each key and its fallback decides
    assert spec_of({**base, "remote_port": "x"}) == ReleaseSpec("t", "h", 9000)
    assert spec_of({**base, "remote_handshake_port": None, "remote_port": 9100}) == ReleaseSpec("t", "h", 9100)
    assert spec_of({**base, "remote_handshake_port": 0, "remote_port": 9100}) is None
    assert spec_of({**base, "tp_size": 4, "dp_rank": 1}) == ReleaseSpec("t", "h", 9000, 4, 1, 1, 2)
    assert spec_of({**base, "remote_tp_size": 2, "tp_size": "x"}) == ReleaseSpec("t", "h", 9000, 2)
    for bad in ({"remote_tp_size": 0}, {"remote_tp_size": "2"}, {"dp_rank": -1}, {"remote_dp_rank": "a"},
                {"transfer_id": ""}, {"remote_host": 5}, {"do_remote_prefill": "true"}, {"do_remote_prefill": False},
                {"remote_tp_size": 1025}, {"remote_tp_size": 2_000_000}, {"remote_dp_rank": 1024},
                {"remote_handshake_port": 65535, "remote_tp_size": 2},
                {"remote_handshake_port": 65000, "remote_tp_size": 512, "remote_dp_rank": 2}):
        assert spec_of({**base, **bad}) is None, bad
    # too many stages for the TP size: the first stage is still released
    assert spec_of({**base, "remote_tp_size": 32, "remote_pp_size": 64}) == ReleaseSpec("t", "h", 9000, 32)
    assert spec_of(None) is None and spec_of([1, 2]) is None and spec_of("x") is None


def test_refusals_name_the_first_bad_key_and_a_bad_transfer_id_never_refuses_a_send():
    p = RequestParams.parse({"do_remote_decode": True, "transfer_id": 42, "remote_tp_size": 0})
    assert p.refusal == "`transfer_id` must be a string or null, got 42"
    assert p.send_refusal == "`remote_tp_size` must be an integer in 1..1024, got 0"
    q = RequestParams.parse({"do_remote_decode": True, "transfer_id": ""})
    assert q.refusal is not None and q.send_refusal is None and q.adoptable_transfer_id is None
    assert q.offered_transfer_id == ""
    assert RequestParams.parse({"transfer_id": "tab\there"}).adoptable_transfer_id is None
    assert RequestParams.parse({"transfer_id": "cmpl-1"}).adoptable_transfer_id == "cmpl-1"
    assert RequestParams.parse([1]).refusal == "`kv_transfer_params` must be an object, got list"
    assert RequestParams.parse(None) == RequestParams()
