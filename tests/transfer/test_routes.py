"""``auto``'s choice of inner backend, for every pair of memory kinds."""

from __future__ import annotations

import pytest

from atom_kv.transfer.routes import ROUTES, Route, choose_route

H, G = frozenset({"host"}), frozenset({"gpu"})
ALL = frozenset({"tcp", "cma", "gpu_ipc"})


@pytest.mark.parametrize(
    "local, peer, same_host, offered, expected",
    [
        (G, G, True, ALL, "gpu_ipc"),
        (G, G, False, ALL, "tcp"),  # staged
        (H, H, True, ALL, "cma"),
        (H, H, False, ALL, "tcp"),
        (G, H, True, ALL, "tcp"),  # mixed kinds: staged tcp on either side
        (H, G, True, ALL, "tcp"),
        (G, H, False, ALL, "tcp"),
        (H, G, False, ALL, "tcp"),
        (H | G, H, True, ALL, "tcp"),  # a process with both kinds registered
        (G, G, True, frozenset({"tcp", "cma"}), "tcp"),  # no gpu_ipc on one side
        (H, H, True, frozenset({"tcp"}), "tcp"),  # cma not usable here
        (G, G, False, ALL | {"nixl"}, "nixl"),  # GPU across hosts: RDMA through NIXL before staged tcp
        (G, G, True, ALL | {"nixl"}, "gpu_ipc"),  # one host: IPC stays first
        (H, H, False, ALL | {"nixl"}, "tcp"),  # host memory across hosts: tcp
        (G, H, False, ALL | {"nixl"}, "tcp"),  # mixed kinds: staged tcp
        (G, G, False, frozenset({"tcp", "cma"}), "tcp"),  # NIXL not on both sides
    ],
)
def test_choice_per_pair_of_kinds(local, peer, same_host, offered, expected):
    assert choose_route(local, peer, same_host=same_host, offered=offered) == expected


def test_a_new_route_extends_the_preference_list():
    rdma = Route("rdma", G, G, same_host=False)
    routes = ROUTES[:-1] + (rdma,) + ROUTES[-1:]
    assert choose_route(G, G, same_host=False, offered=ALL | {"rdma"}, routes=routes) == "rdma"
    assert choose_route(G, G, same_host=True, offered=ALL | {"rdma"}, routes=routes) == "gpu_ipc"
    assert choose_route(G, G, same_host=False, offered=ALL, routes=routes) == "tcp"


def test_no_route_is_one_line():
    with pytest.raises(ValueError, match="no transfer route reads gpu memory into host memory across hosts"):
        choose_route(H, G, same_host=False, offered=frozenset({"cma"}))
