"""Per-block KV checksums (``--kv-checksums``): what they sum, how a TP 2 and a
TP 1 engine name the same head, that a differing byte is found, and the e2e
bench comparing a decode engine's loads with its prefill's at unequal TP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from atom_kv.reference.kv_checksums import KVChecksums, compare, read_records

ROOT = Path(__file__).resolve().parents[2]


def _layers(cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(cache, cache + 1)]


def test_a_tp2_producer_and_a_tp1_consumer_name_heads_alike_and_a_changed_byte_differs(tmp_path):
    full = torch.randn(8, 2, 4, 8)  # [blocks, 2 KV heads, block size, head dim]
    p0, p1 = KVChecksums(str(tmp_path / "P"), "p", 0, 0, 1), KVChecksums(str(tmp_path / "P"), "p", 0, 1, 1)
    send = SimpleNamespace(transfer_id="t1", block_ids=[5, 2, 7])
    p0.sent(_layers(full[:, :1].contiguous()), [send])  # rank 0 holds head 0, rank 1 head 1
    p1.sent(_layers(full[:, 1:].contiguous()), [send])
    d = KVChecksums(str(tmp_path / "D"), "d", 0, 0, 2)
    loaded = torch.zeros_like(full)
    loaded[[0, 1, 3]] = full[[5, 2, 7]]  # the consumer's own block ids differ
    d.loading([SimpleNamespace(request_id="r", transfer_id="t1", block_ids=[0, 1, 3], remote_block_ids=[5, 2, 7])])
    d.loaded(_layers(loaded), ["r"])
    got = compare(read_records(str(tmp_path / "P")), read_records(str(tmp_path / "D")))
    # 3 blocks x 1 layer x (k, v) x 2 heads
    assert got["equal"] is True and got["compared"] == 12 and got["differ"] == 0 and got["transfers"] == 1

    loaded[3, 1, 2, 5] += 1.0  # one value of head 1 in the block read from the producer's block 7
    (tmp_path / "D" / "d-dp0-tp0.jsonl").unlink()
    d.loading([SimpleNamespace(request_id="r", transfer_id="t1", block_ids=[0, 1, 3], remote_block_ids=[5, 2, 7])])
    d.loaded(_layers(loaded), ["r"])
    got = compare(read_records(str(tmp_path / "P")), read_records(str(tmp_path / "D")))
    assert got["equal"] is False and got["differ"] == 2  # k and v (v = k + 1 here)
    assert sorted(map(tuple, got["first_differing"])) == [("t1", 7, 0, 0, 1), ("t1", 7, 0, 1, 1)]


def test_swapped_words_and_an_unlent_block_are_not_equal(tmp_path):
    a = torch.arange(64, dtype=torch.float32).view(1, 1, 8, 8)
    b = a.clone().view(-1)
    b[[0, 1]] = b[[1, 0]]  # the same words in another order: the plain sums agree, the weighted ones do not
    p = KVChecksums(str(tmp_path / "P"), "p", 0, 0, 1)
    p.sent([(a, a)], [SimpleNamespace(transfer_id="t", block_ids=[0])])
    d = KVChecksums(str(tmp_path / "D"), "d", 0, 0, 1)
    d.loading([SimpleNamespace(request_id="r", transfer_id="t", block_ids=[0], remote_block_ids=[0])])
    d.loaded([(b.view(1, 1, 8, 8), a)], ["r"])
    got = compare(read_records(str(tmp_path / "P")), read_records(str(tmp_path / "D")))
    assert got["differ"] == 1 and got["compared"] == 2 and not got["equal"]
    assert compare([], read_records(str(tmp_path / "D")))["missing"] == 2
    assert compare(read_records(str(tmp_path / "P")), [])["equal"] is False  # nothing loaded: nothing shown equal


def test_e2e_bench_compares_loaded_kv_with_the_lent_kv_at_tp_1_to_2():
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", "e2e", "--tp-prefill", "1", "--tp-decode", "2",
                          "--sizes", "512", "--repeats", "1", "--max-tokens", "4", "--kv-checksums", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.find("{"):])
    sums = doc["kv_checksums"]
    # the warm-up and the measured request, every block of both heads of every layer, k and v
    assert sums["equal"] is True and sums["transfers"] == 2 and sums["compared"] > 0 and sums["differ"] == 0
