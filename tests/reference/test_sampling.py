"""Sampling: greedy, seeded (reproducible anywhere) and unseeded (fresh entropy per request)."""

import numpy as np

from atom_kv.reference.sampling import Sampler

LOGITS = np.zeros(260, dtype=np.float32)  # a flat distribution over the allowed tokens


def _draw(sampler, rid, seed, n=24, temperature=1.0, start=0):
    return [sampler.sample(rid, LOGITS, temperature, seed, position=i) for i in range(start, start + n)]


def test_seeded_sampling_is_reproducible_across_samplers():
    assert _draw(Sampler(), "a", 7) == _draw(Sampler(), "b", 7)
    assert _draw(Sampler(), "a", 7) != _draw(Sampler(), "a", 8)


def test_unseeded_sampling_is_not_deterministic():
    sampler = Sampler()
    first, second = _draw(sampler, "a", None), _draw(sampler, "b", None)
    again = _draw(Sampler(), "a", None)
    # 24 draws from 96 equally likely tokens: equal sequences would mean a fixed seed
    assert first != second and first != again


def test_greedy_is_the_argmax_whatever_the_seed():
    logits = LOGITS.copy()
    logits[ord("k")] = 5.0
    sampler = Sampler()
    assert sampler.sample("r", logits, 0.0, None) == ord("k") == sampler.sample("r", logits, 0.0, 3)


def test_seeded_sampling_depends_on_the_position_only():
    # a decode engine continuing from the prefill's first token samples positions 1.. exactly as a
    # colocated engine does, without drawing position 0 again
    colocated = _draw(Sampler(), "a", 11)
    assert _draw(Sampler(), "b", 11, n=23, start=1) == colocated[1:]
    assert len(set(colocated)) > 1  # positions differ from one another
