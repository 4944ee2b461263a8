"""Fuzzing the scheduler hooks both engine adapters call with a request's ``kv_transfer_params`` (issue 38).

ATOM passes the client's value as it came, vLLM a dict of anything: here the
connector's scheduler side (prefill and decode) gets random values, random
keys of the real schema with random values, and valid params with one key
broken, through the calls an engine makes for one request (match, allocate,
a step's metadata and output, finish or reject). Asserted: nothing raises,
and a request that matched nothing loads nothing. A recording release sender
stands in for the network, and every release it records names at most
``MAX_RELEASE_RANKS`` ports within 1..65535 (the F2 bound). Bounded: a few hundred
examples, a few seconds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_kv.config import KVTransferConfig
from atom_kv.connector.release import MAX_RELEASE_RANKS
from atom_kv.connector.scheduler import ConnectorScheduler, RoleScheduler
from atom_kv.engine_hooks import KVConnectorOutput
from atom_kv.wire import KVTransferParams

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = list(KVTransferParams.__struct_fields__)
VALID = {"do_remote_prefill": True, "remote_block_ids": [5, 6, 7], "remote_engine_id": "P",
         "remote_host": "127.0.0.1", "remote_handshake_port": 7000, "transfer_id": "t-1", "remote_tp_size": 1}

_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
            | st.text(max_size=12) | st.sampled_from([0, 1, 65535, 65536, 2_000_000, -1, "127.0.0.1", ""]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6),
                                                                                                inner, max_size=3),
                       max_leaves=8)
_params = (_values
           | st.dictionaries(st.sampled_from(KEYS), _values, max_size=8)
           | st.tuples(st.sampled_from(KEYS), _values).map(lambda kv: {**VALID, kv[0]: kv[1]}))


def _hooks(role: str, sent: list) -> RoleScheduler:
    return ConnectorScheduler(KVTransferConfig(kv_role=role, abort_timeout_s=5.0), engine_id="E", host="127.0.0.1",
                              tp_size=1, block_size=4, release_sender=lambda spec, reason: sent.append(spec))


@FUZZ
@given(params=_params, role=st.sampled_from(["kv_producer", "kv_consumer"]), reject=st.booleans(),
       blocks=st.lists(st.integers(0, 31), max_size=5))
def test_no_kv_transfer_params_make_the_scheduler_hooks_raise(params, role, reject, blocks):
    sent: list = []
    h = _hooks(role, sent)
    if reject:
        h.request_rejected(params)
    else:
        n, is_async = h.get_num_new_matched_tokens("r", 12, params)
        assert n >= 0 and isinstance(is_async, bool)
        h.update_state_after_alloc("r", blocks, n)
        meta = h.build_connector_meta()
        if n == 0:
            assert meta.loads == []
        h.update_connector_output(KVConnectorOutput(failed_recving={"r": "fuzz"}))
        h.request_finished("r", blocks, aborted=bool(blocks), first_token_ids=[65])
    h.close()
    for spec in sent:  # whatever the client named, a release reaches a bounded set of real ports
        targets = spec.targets()
        assert len(targets) <= MAX_RELEASE_RANKS and all(1 <= port <= 65535 for _, port in targets), spec
