"""Test helpers: a small synthetic KV shape, a deterministic byte pattern per
(layer, kind, head, block), and a tiny block pool that tracks ownership."""

from __future__ import annotations

import socket

import torch

from atom_kv.config import KVTransferConfig
from atom_kv.wire import CompatInfo

LAYERS = 2
HEADS = 4
HEAD_DIM = 16
BLOCK = 16
LATENT = 32


def compat(*, block_size: int = BLOCK, is_mla: bool = False, model: str = "tiny") -> CompatInfo:
    return CompatInfo(model_id=model, dtype="float32", num_layers=LAYERS, num_kv_heads=1 if is_mla else HEADS,
                      head_dim=LATENT if is_mla else HEAD_DIM, block_size=block_size, is_mla=is_mla)


#: the data-path listeners' ports left to the OS: tests pick only a free handshake port
#: (tests/connector/test_port_plan.py tests the planned ones, passing None)
OS_ASSIGNED = dict(tcp_port=0, cma_grant_port=0, gpu_ipc_grant_port=0, moriio_port=0)


def config(role: str, port: int, **overrides) -> KVTransferConfig:
    base = dict(kv_role=role, handshake_port=port, handshake_timeout_s=2.0, transfer_timeout_s=2.0,
                abort_timeout_s=30.0, transfer_retries=1, transfer_retry_backoff_ms=20.0, **OS_ASSIGNED)
    base.update(overrides)
    return KVTransferConfig.from_dict(base)


def pattern(layer: int, kind: int, heads: torch.Tensor, blocks: torch.Tensor, num_blocks: int,
            inner: int = BLOCK * HEAD_DIM) -> torch.Tensor:
    """Values ``[len(blocks), len(heads), inner]``, unique per (layer, kind, head, block, position), exact in float32."""
    base = ((layer * 2 + kind) * HEADS + heads.view(1, -1)) * num_blocks + blocks.view(-1, 1)
    return (base.unsqueeze(-1) * inner + torch.arange(inner).view(1, 1, -1)).to(torch.float32)


def make_caches(num_blocks: int, tp_rank: int, tp_size: int, *, fill: bool, is_mla: bool = False):
    """One rank's caches: producer ranks get the pattern, consumer ranks -1."""
    layers = []
    hl = HEADS // tp_size
    heads = torch.arange(tp_rank * hl, (tp_rank + 1) * hl)
    blocks = torch.arange(num_blocks)
    for layer in range(LAYERS):
        if is_mla:
            t = torch.full((num_blocks, BLOCK, LATENT), -1.0)
            if fill:
                t.copy_(pattern(layer, 0, torch.arange(1), blocks, num_blocks, BLOCK * LATENT).view(t.shape))
            layers.append(t)
            continue
        pair = []
        for kind in range(2):
            t = torch.full((num_blocks, hl, BLOCK, HEAD_DIM), -1.0)
            if fill:
                t.copy_(pattern(layer, kind, heads, blocks, num_blocks).view(t.shape))
            pair.append(t)
        layers.append(tuple(pair))
    return layers


def check_blocks(caches, pairs: list[tuple[int, int]], tp_rank: int, tp_size: int, remote_num_blocks: int,
                 *, is_mla: bool = False) -> str:
    """'' when every destination block holds the producer's bytes, else what differs."""
    if not pairs:
        return ""
    local = torch.tensor([p[0] for p in pairs])
    remote = torch.tensor([p[1] for p in pairs])
    hl = HEADS // tp_size
    heads = torch.arange(tp_rank * hl, (tp_rank + 1) * hl)
    for layer, entry in enumerate(caches):
        if is_mla:
            want = pattern(layer, 0, torch.arange(1), remote, remote_num_blocks, BLOCK * LATENT)
            got = entry[local].reshape(want.shape)
            if not torch.equal(got, want):
                return f"layer {layer} latent differs"
            continue
        for kind, t in enumerate(entry):
            want = pattern(layer, kind, heads, remote, remote_num_blocks)
            got = t[local].reshape(want.shape)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                return f"layer {layer} kind {kind}: block pair {pairs[bad[0]]} head {bad[1]} differs"
    return ""


def untouched(caches, blocks: list[int]) -> bool:
    """True when every given block still holds -1 everywhere."""
    idx = torch.tensor(blocks, dtype=torch.long)
    for entry in caches:
        for t in (entry if isinstance(entry, tuple) else (entry,)):
            if not bool((t[idx] == -1).all()):
                return False
    return True


class BlockPool:
    """Hands out block ids and remembers who holds them; freeing twice is an error."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.held: dict[str, list[int]] = {}

    def alloc(self, rid: str, n: int) -> list[int]:
        assert rid not in self.held, f"{rid} allocated twice"
        assert len(self.free_ids) >= n, "pool exhausted"
        blocks = [self.free_ids.pop() for _ in range(n)]
        self.held[rid] = blocks
        return blocks

    def free(self, rid: str) -> None:
        assert rid in self.held, f"{rid} freed twice or never allocated"
        self.free_ids.extend(reversed(self.held.pop(rid)))


def port_range(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")
