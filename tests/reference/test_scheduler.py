"""Scheduler: admission under block pressure, rejection, aborts, connector events (real scheduler hooks)."""

import pytest

from atom_kv import engine_hooks
from atom_kv.config import KVTransferConfig
from atom_kv.engine_hooks import KVConnectorOutput
from atom_kv.reference.request import Request, RequestError, RequestState
from atom_kv.reference.scheduler import Scheduler


def _sched(num_blocks=8, block_size=4, max_num_seqs=8, hooks=None):
    return Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                     max_model_len=1024, max_num_batched_tokens=4096, hooks=hooks)


def _req(rid, n_prompt=6, max_tokens=2, params=None):
    return Request(request_id=rid, prompt_ids=list(range(1, n_prompt + 1)), max_tokens=max_tokens,
                   kv_transfer_params=params)


def _run_to_completion(s: Scheduler, limit=100):
    finished = []
    for _ in range(limit):
        out = s.schedule()
        if not out.chunks:
            break
        outs = s.update_from_output({c.request_id: 65 for c in out.chunks}, 0.0)
        finished += [o for o in outs if o.finished]
    return finished


def test_requests_wait_when_blocks_run_out_then_run():
    s = _sched(num_blocks=4, block_size=4)
    s.add(_req("a", n_prompt=6, max_tokens=2))  # 2 blocks
    s.add(_req("b", n_prompt=6, max_tokens=2))  # 2 blocks
    s.add(_req("c", n_prompt=6, max_tokens=2))  # must wait
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.blocks.num_free == 0
    finished = _run_to_completion(s)
    assert sorted(o.request_id for o in finished) == ["a", "b", "c"]
    assert s.blocks.num_free == 4 and s.num_unfinished == 0


def test_max_num_seqs_limits_running():
    s = _sched(num_blocks=64, max_num_seqs=2)
    for rid in "abc":
        s.add(_req(rid))
    assert len(s.schedule().chunks) == 2
    assert len(s.waiting) == 1


def test_request_that_never_fits_is_rejected_with_a_clear_error():
    s = _sched(num_blocks=4, block_size=4)
    with pytest.raises(RequestError, match="prompt needs 5 blocks .* but the engine has only 4") as info:
        s.add(_req("big", n_prompt=18, max_tokens=2))
    assert info.value.status == 400
    assert s.num_unfinished == 0


def test_abort_frees_blocks_in_every_state():
    s = _sched(num_blocks=4, block_size=4)
    s.add(_req("a"))
    s.add(_req("b"))
    s.add(_req("c"))
    s.schedule()
    assert s.blocks.num_free == 0
    assert s.abort("a") and s.abort("c")  # running, waiting
    assert s.blocks.num_free == 2
    assert not s.abort("a")
    _run_to_completion(s)
    assert s.blocks.num_free == 4


def test_decode_chunks_continue_from_computed_position():
    s = _sched()
    s.add(_req("a", n_prompt=5, max_tokens=3))
    first = s.schedule().chunks[0]
    assert (first.start_pos, len(first.token_ids)) == (0, 5)
    s.update_from_output({"a": 70}, 0.0)
    second = s.schedule().chunks[0]
    assert (second.start_pos, second.token_ids) == (5, [70])


_made: list = []


def _hooks(role: str):
    cfg = KVTransferConfig(kv_role=role, abort_timeout_s=5.0)
    hooks = engine_hooks.build_scheduler_hooks(cfg, engine_id="eng-test", host="127.0.0.1", tp_size=1, block_size=4)
    _made.append(hooks)
    return hooks


@pytest.fixture(autouse=True)
def _close_hooks():
    yield
    while _made:
        _made.pop().close()  # a consumer's hooks own the thread that sends releases


def test_producer_holds_blocks_until_free_event():
    hooks = _hooks("kv_producer")
    s = _sched(num_blocks=8, block_size=4, hooks=hooks)
    s.add(_req("p1", n_prompt=6, max_tokens=1, params={"do_remote_decode": True}))
    out = s.schedule()
    (fin,) = s.update_from_output({c.request_id: 66 for c in out.chunks}, 0.0)
    assert fin.finished and fin.kv_transfer_params["do_remote_prefill"] is True
    tid = fin.kv_transfer_params["transfer_id"]
    assert len(fin.kv_transfer_params["remote_block_ids"]) == 2
    assert s.blocks.num_free == 6  # prompt blocks held, the rest freed
    meta = hooks.build_connector_meta()
    assert [x.transfer_id for x in meta.sends] == [tid]
    events = hooks.update_connector_output(KVConnectorOutput(finished_sending=[tid]))
    assert events.free == ["p1"]
    s.apply_events(events)
    assert s.blocks.num_free == 8 and not s.held


def test_consumer_waits_for_remote_kv_then_computes_only_the_last_token():
    hooks = _hooks("kv_consumer")
    s = _sched(num_blocks=8, block_size=4, hooks=hooks)
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 7000, "transfer_id": "p-x", "remote_tp_size": 1}
    s.add(_req("d1", n_prompt=6, max_tokens=2, params=params))
    assert s.schedule().chunks == []
    assert s.waiting_remote["d1"].state is RequestState.WAITING_FOR_REMOTE_KV
    meta = hooks.build_connector_meta()
    assert [x.request_id for x in meta.loads] == ["d1"]
    assert meta.loads[0].remote_block_ids == [3, 4]
    s.apply_events(hooks.update_connector_output(KVConnectorOutput(finished_recving=["d1"])))
    chunk = s.schedule().chunks[0]
    assert (chunk.start_pos, chunk.token_ids) == (5, [6])


def test_consumer_load_failure_ends_request_and_frees_blocks():
    hooks = _hooks("kv_consumer")
    s = _sched(num_blocks=8, block_size=4, hooks=hooks)
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 7000, "transfer_id": "p-y"}
    s.add(_req("d2", n_prompt=6, params=params))
    s.schedule()
    hooks.build_connector_meta()
    outs = s.apply_events(hooks.update_connector_output(KVConnectorOutput(failed_recving={"d2": "peer gone"})))
    assert len(outs) == 1 and outs[0].finished and "peer gone" in outs[0].error
    assert outs[0].error_status >= 500 and outs[0].error_side == "prefill"  # the prefill side's failure
    assert s.blocks.num_free == 8 and s.num_unfinished == 0


class _RecordingHooks:
    """Scheduler hooks that only record which calls the scheduler makes (a stand-in for the connector)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return (0, False) if name == "get_num_new_matched_tokens" else (False, None)
        return record


def test_a_request_aborted_before_admission_is_reported_as_rejected():
    hooks = _RecordingHooks()
    s = _sched(num_blocks=8, block_size=4, max_num_seqs=8, hooks=hooks)
    s.add(_req("big", n_prompt=20, max_tokens=4))  # takes 6 of the 8 blocks
    params = {"do_remote_prefill": True, "transfer_id": "p-z", "remote_host": "127.0.0.1", "remote_port": 7000}
    s.add(_req("d1", n_prompt=12, max_tokens=4, params=params))  # needs 4: waits for blocks
    s.schedule()
    assert [c[1][0] for c in hooks.calls] == ["big"]  # d1 never admitted: the hooks have not seen it
    assert s.abort("d1")
    assert hooks.calls[1:] == [("request_rejected", (params,), {})]


def test_every_request_of_a_failed_engine_is_reported_as_rejected():
    hooks = _RecordingHooks()
    s = _sched(num_blocks=8, block_size=4, hooks=hooks)
    s.add(_req("a", n_prompt=6, max_tokens=2, params={"x": 1}))
    s.add(_req("b", n_prompt=6, max_tokens=2, params=None))
    outs = s.fail_all("engine died")
    assert [o.error_status for o in outs] == [503, 503]
    assert [c for c in hooks.calls if c[0] == "request_rejected"] == [
        ("request_rejected", ({"x": 1},), {}), ("request_rejected", (None,), {})]


def _loaded_consumer(first_token_ids, n_prompt=6, max_tokens=3):
    hooks = _hooks("kv_consumer")
    s = _sched(num_blocks=8, block_size=4, hooks=hooks)
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 7000, "transfer_id": "p-x", "remote_tp_size": 1,
              "first_token_ids": first_token_ids}
    s.add(_req("d1", n_prompt=n_prompt, max_tokens=max_tokens, params=params))
    assert s.schedule().chunks == []
    hooks.build_connector_meta()
    return s, s.apply_events(hooks.update_connector_output(KVConnectorOutput(finished_recving=["d1"])))


def test_producer_answers_with_its_first_token():
    s = _sched(num_blocks=8, block_size=4, hooks=_hooks("kv_producer"))
    s.add(_req("p1", n_prompt=6, max_tokens=1, params={"do_remote_decode": True}))
    (fin,) = s.update_from_output({c.request_id: 66 for c in s.schedule().chunks}, 0.0)
    assert fin.kv_transfer_params["first_token_ids"] == [66]


def test_consumer_continues_from_the_prefills_first_token():
    s, outs = _loaded_consumer([70])
    # the prefill's token is the request's first output, released at once
    (first,) = outs
    assert first.new_token_ids == [70] and first.num_output_tokens == 1 and not first.finished
    # the next step computes the first token's position (nothing of the prompt again) for the second token
    chunk = s.schedule().chunks[0]
    assert (chunk.start_pos, chunk.token_ids) == (6, [70])
    (second,) = s.update_from_output({"d1": 71}, 0.0)
    assert second.new_token_ids == [71] and second.num_output_tokens == 2


def test_consumer_with_max_tokens_one_finishes_on_the_prefills_token():
    s, outs = _loaded_consumer([70], max_tokens=1)
    (only,) = outs
    assert only.finished and only.finish_reason == "length" and only.num_output_tokens == 1
    assert not s.running and s.blocks.num_free == 8


@pytest.mark.parametrize("bad", [[], [70, 71], ["a"], [-1], [100000], True, None])
def test_consumer_ignores_a_malformed_first_token(bad):
    s, outs = _loaded_consumer(bad)
    assert outs == []
    chunk = s.schedule().chunks[0]
    assert (chunk.start_pos, chunk.token_ids) == (5, [6])  # recomputes the last prompt token, as before
