"""A rank's route view: bounded (the newest peers shown, the rest counted),
forgetting dropped peers, and carrying ``auto``'s fallbacks by reason."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.connector.routes_view import MAX_ROUTES_SHOWN, RouteView, backend_for_peer
from atom_kv.transfer import create_backend
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason


def _record(view: RouteView, i: int, backend: str = "tcp") -> None:
    view.record(("P", "127.0.0.1", 9000 + i), peer=f"P{i}", peer_dp_rank=0, peer_rank=0, memory=["host"],
                backend=backend)


def test_only_the_newest_routes_are_shown_and_the_rest_counted():
    view = RouteView()
    for i in range(MAX_ROUTES_SHOWN + 5):
        _record(view, i)
    report = view.report()
    assert len(report.routes) == MAX_ROUTES_SHOWN and report.hidden == 5
    assert [r.peer for r in report.routes] == [f"P{i}" for i in range(5, MAX_ROUTES_SHOWN + 5)]
    _record(view, 0, backend="cma")  # a hidden peer handshakes again: shown, the oldest shown one hidden
    report = view.report()
    assert report.routes[-1].peer == "P0" and report.routes[-1].backend == "cma" and report.hidden == 5
    assert "P5" not in {r.peer for r in report.routes}


def test_a_dropped_peer_is_forgotten_and_a_new_handshake_replaces_its_route():
    view = RouteView()
    _record(view, 1, backend="cma")
    _record(view, 1, backend="tcp")
    assert [(r.peer, r.backend) for r in view.report().routes] == [("P1", "tcp")]
    view.forget(("P", "127.0.0.1", 9001))
    assert view.report().routes == () and view.report().hidden == 0


def test_memory_kinds_are_joined_and_the_json_form_names_every_field():
    view = RouteView()
    view.record("k", peer="P", peer_dp_rank=1, peer_rank=3, memory=["gpu:0", "host"], backend="tcp")
    assert view.report().as_dict() == {
        "routes": [{"peer": "P", "peer_dp_rank": 1, "peer_rank": 3, "memory": "gpu:0+host", "backend": "tcp"}],
        "hidden": 0, "fallbacks": []}


@pytest.mark.skipif(cma_unavailable_reason() is not None, reason=cma_unavailable_reason() or "")
def test_auto_fallbacks_reach_the_report():
    cfg = KVTransferConfig(kv_role="kv_consumer", transfer_timeout_s=2, handshake_timeout_s=2)
    src = np.zeros(1 << 14, dtype=np.uint8)
    dst = np.zeros_like(src)
    with create_backend("auto", cfg) as a, create_backend("auto", cfg) as b:
        a.register_memory(src.ctypes.data, src.nbytes, align=4096)
        b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
        desc = wire.decode(a.export_descriptor(), wire.AutoDescriptor)
        best = b.add_peer(wire.encode(desc))
        tcp_only = b.add_peer(wire.encode(msgspec.structs.replace(desc, cma=b"")))  # an engine without cma
        assert (backend_for_peer(b, best), backend_for_peer(b, tcp_only)) == ("cma", "tcp")
        assert backend_for_peer(a, "auto/unknown") == "auto"  # a peer it does not know: the backend's own name
        report = RouteView().report(b)
        assert report.fallbacks == (("cma", "not_offered", 1),)
        assert report.as_dict()["fallbacks"] == [{"backend": "cma", "reason": "not_offered", "count": 1}]
