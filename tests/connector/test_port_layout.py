"""The side-channel port layout equals ATOM main's
(``atom/kv_transfer/disaggregation/port_offset.py``):
``handshake_port + pp_rank*(dp_size*tp_size) + dp_rank*tp_size + tp_rank``,
and it is what a producer rank binds and what consumers and releases dial."""

from __future__ import annotations

import itertools

import pytest
import zmq

from atom_kv.connector.peers import producer_port
from atom_kv.connector.params import RequestParams
from atom_kv.connector.release import ReleaseSpec
from atom_kv.connector.types import LoadSpec
from atom_kv.testing.ports import free_plan_base
from atom_kv.wire import handshake_port

from .kvutil import compat, config, make_caches


def atom_offset(dp_rank: int, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, dp_size: int) -> int:
    """ATOM main's ``side_channel_port_offset``, written out from its definition."""
    return pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank


SIZES = [(pp, dp, tp) for pp in (1, 2, 3, 4) for dp in (1, 2, 3, 8) for tp in (1, 2, 4, 8)]


@pytest.mark.parametrize("pp_size,dp_size,tp_size", SIZES)
def test_port_layout_is_atoms_formula(pp_size, dp_size, tp_size):
    base = 6301
    seen = set()
    for pp, dp, tp in itertools.product(range(pp_size), range(dp_size), range(tp_size)):
        port = handshake_port(base, dp, tp_size, tp, pp_rank=pp, dp_size=dp_size)
        assert port == base + atom_offset(dp, tp, tp_size, pp, pp_size, dp_size)
        seen.add(port)
    # one port per rank, packed from the base with no gap
    assert seen == set(range(base, base + pp_size * dp_size * tp_size))


def test_first_stage_keeps_the_pre_pipeline_layout():
    # ATOM's own back-compat rule: with pp_rank 0 the offset is dp_rank*tp_size + tp_rank whatever dp_size is
    for dp_size, dp, tp_size, tp in [(1, 0, 1, 0), (4, 3, 2, 1), (8, 5, 8, 7)]:
        assert handshake_port(7000, dp, tp_size, tp, dp_size=dp_size) == 7000 + dp * tp_size + tp


def test_consumers_and_releases_dial_the_named_dp_rank_only():
    spec = LoadSpec(request_id="r", transfer_id="t", block_ids=[1], remote_block_ids=[2], num_tokens=4,
                    remote_engine_id="p", remote_host="127.0.0.1", remote_handshake_port=9000,
                    remote_tp_size=4, remote_dp_rank=3)
    assert [producer_port(spec, r) for r in range(4)] == [9012, 9013, 9014, 9015]
    assert ReleaseSpec.from_load(spec).targets() == [("127.0.0.1", p) for p in (9012, 9013, 9014, 9015)]
    rel = RequestParams.parse({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h",
                               "remote_handshake_port": 9000, "remote_tp_size": 2, "remote_dp_rank": 5}).release_spec
    assert rel is not None and rel.targets() == [("h", 9010), ("h", 9011)]


def test_producer_ranks_bind_the_layout_ports():
    """Real producer workers at every (pp, dp, tp) of a 2x2x2 layout each listen on their formula port."""
    from atom_kv import engine_hooks

    pp_size, dp_size, tp_size = 2, 2, 2
    base = free_plan_base(pp_size * dp_size * tp_size)
    cfg = config("kv_producer", base)
    workers = []
    try:
        for pp, dp, tp in itertools.product(range(pp_size), range(dp_size), range(tp_size)):
            w = engine_hooks.build_worker_hooks(cfg, engine_id=f"p-pp{pp}-dp{dp}", host="127.0.0.1", tp_rank=tp,
                                                tp_size=tp_size, dp_rank=dp, dp_size=dp_size, pp_rank=pp,
                                                pp_size=pp_size, compat=compat())
            workers.append(w)
            w.register_kv_caches(make_caches(4, tp, tp_size, fill=True))
            port = base + atom_offset(dp, tp, tp_size, pp, pp_size, dp_size)
            # the port is taken: binding it again fails
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                with pytest.raises(zmq.ZMQError):
                    sock.bind(f"tcp://127.0.0.1:{port}")
            finally:
                sock.close()
    finally:
        for w in workers:
            w.close()


def test_rank_outside_its_size_is_refused():
    from atom_kv import engine_hooks

    with pytest.raises(ValueError, match="dp_rank 2 is outside dp_size 2"):
        engine_hooks.build_worker_hooks(config("kv_producer", 7000), engine_id="p", host="127.0.0.1", tp_rank=0,
                                        tp_size=1, dp_rank=2, dp_size=2, compat=compat())
