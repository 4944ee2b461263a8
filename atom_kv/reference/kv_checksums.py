"""Per-block checksums of the KV a prefill engine lent and a decode engine
loaded, so that the bytes can be compared across unequal TP (a checking
aid: ``--kv-checksums DIR``, used by ``python -m atom_kv.bench e2e
--kv-checksums``).

Each rank appends JSON lines to ``DIR/<engine id>-dp<d>-tp<r>.jsonl``:

- a producer, for every transfer it lends (``SendSpec``), before the step's
  forward (its prompt's KV is written by then): ``{"side": "sent",
  "transfer": id, "blocks": [its block ids], "sums": ...}``;
- a consumer, for every load the connector reports finished, before the
  engine schedules its decode: ``{"side": "loaded", "transfer": id,
  "blocks": [the producer's block ids], "sums": ...}``.

``sums[layer][k or v][global head][block]`` is a pair of integers over the
block's bytes of that head (their int32 words summed, and summed with their
position as weight): equal bytes give equal sums, on any device. A head's
global index is ``tp_rank * local heads + local head``, so TP 2 and TP 1
engines name the same head the same way. :func:`compare` reads a
producer's and a consumer's files and matches them per (transfer, block,
layer, k/v, head).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterable

__all__ = ["KVChecksums", "compare", "read_records"]


class KVChecksums:
    """Owns one rank's checksum file (opened per write, appended, closed)."""

    def __init__(self, directory: str, engine_id: str, dp_rank: int, tp_rank: int, kv_heads_local: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, f"{engine_id}-dp{dp_rank}-tp{tp_rank}.jsonl")
        self._first_head = tp_rank * kv_heads_local
        self._loads: dict[str, tuple[str, list[int], list[int]]] = {}  # request -> (transfer, local, remote)

    def sent(self, layers: list[tuple[Any, Any]], sends: Iterable[Any]) -> None:
        for send in sends:
            self._write("sent", send.transfer_id, list(send.block_ids), list(send.block_ids), layers)

    def loading(self, loads: Iterable[Any]) -> None:
        for load in loads:
            n = min(len(load.block_ids), len(load.remote_block_ids))
            self._loads[load.request_id] = (load.transfer_id, list(load.block_ids)[-n:] if n else [],
                                            list(load.remote_block_ids)[-n:] if n else [])

    def loaded(self, layers: list[tuple[Any, Any]], request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            entry = self._loads.pop(rid, None)
            if entry is not None and entry[1]:
                transfer, local, remote = entry
                self._write("loaded", transfer, local, remote, layers)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._loads.pop(rid, None)

    def _write(self, side: str, transfer: str, local: list[int], named: list[int], layers: list[tuple[Any, Any]]) -> None:
        sums = [[_sums(t, local) for t in kv] for kv in layers]
        record = {"side": side, "transfer": transfer, "blocks": named, "first_head": self._first_head, "sums": sums}
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _sums(cache: Any, blocks: list[int]) -> list[list[list[int]]]:
    """Per local head, per block: [sum of int32 words, position-weighted sum] of ``cache[block, head]``."""
    import torch

    idx = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    words = cache.index_select(0, idx).contiguous().view(torch.int32).to(torch.int64)  # [blocks, heads, bs, hd]
    words = words.flatten(2)
    weights = torch.arange(1, words.shape[2] + 1, dtype=torch.int64, device=cache.device)
    plain = words.sum(dim=2)
    weighted = (words * weights).sum(dim=2)
    pairs = torch.stack([plain, weighted], dim=2).transpose(0, 1).cpu()  # [heads, blocks, 2]
    return pairs.tolist()


def read_records(directory: str) -> list[dict[str, Any]]:
    """Every record the ranks of the engines given ``directory`` wrote."""
    out: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out


def _by_key(records: list[dict[str, Any]], side: str) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for r in records:
        if r["side"] != side:
            continue
        for layer, kv in enumerate(r["sums"]):
            for which, heads in enumerate(kv):
                for h, per_block in enumerate(heads):
                    for block, pair in zip(r["blocks"], per_block):
                        out[(r["transfer"], block, layer, which, r["first_head"] + h)] = pair
    return out


def compare(producer: list[dict[str, Any]], consumer: list[dict[str, Any]]) -> dict[str, Any]:
    """Match what the consumer loaded to what the producer lent, per (transfer,
    block, layer, k/v, head): how many matched, how many differ or are
    missing on the producer's side (with the first few), and whether the
    consumer loaded anything at all."""
    sent, loaded = _by_key(producer, "sent"), _by_key(consumer, "loaded")
    differ = [k for k, v in loaded.items() if k in sent and sent[k] != v]
    missing = [k for k in loaded if k not in sent]
    return {"compared": len(loaded) - len(missing), "differ": len(differ), "missing": len(missing),
            "transfers": len({k[0] for k in loaded}), "first_differing": [list(k) for k in differ[:3]],
            "equal": bool(loaded) and not differ and not missing}

