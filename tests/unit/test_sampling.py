"""Temperature, top-k and top-p (nucleus) sampling (``moetrain.train.generation``) against
distributions worked out by hand."""

import math

import pytest
import torch

from moetrain.train.generation import filter_logits, sample_next


def log(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def distribution(logits_BV: torch.Tensor, **kwargs) -> list[float]:
    return torch.softmax(filter_logits(logits_BV, **kwargs), dim=-1)[0].tolist()


def test_top_p_keeps_the_smallest_most_likely_set_reaching_p():
    probs = [0.05, 0.5, 0.1, 0.2, 0.15]
    # Most likely first: 0.5 (mass before it 0), 0.2 (0.5), 0.15 (0.7), 0.1 (0.85), 0.05 (0.95).
    # p = 0.75 keeps those with mass before < 0.75: ids 1, 3, 4, renormalised by 0.85.
    expected = [0, 0.5 / 0.85, 0, 0.2 / 0.85, 0.15 / 0.85]
    assert distribution(log(probs), top_p=0.75) == pytest.approx(expected, abs=1e-6)
    # p = 0.4: the most likely token alone already holds it.
    assert distribution(log(probs), top_p=0.4) == pytest.approx([0, 1, 0, 0, 0], abs=1e-6)
    # p = 0.9: mass before 0.05 is 0.95 >= 0.9, so four tokens stay.
    assert distribution(log(probs), top_p=0.9) == pytest.approx([0, 0.5 / 0.95, 0.1 / 0.95, 0.2 / 0.95, 0.15 / 0.95],
                                                               abs=1e-6)
    assert distribution(log(probs), top_p=1.0) == pytest.approx(probs, abs=1e-6)


def test_top_k_keeps_the_k_most_likely_and_ties_keep_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    kept = [p > 0 for p in distribution(logits, top_k=3)]
    assert kept == [False, True, True, True, False]
    e = math.exp
    z = e(3) + e(3)
    assert distribution(logits, top_k=2) == pytest.approx([0, e(3) / z, 0, e(3) / z, 0], abs=1e-6)
    tied = torch.tensor([[2.0, 1.0, 2.0, 2.0]])
    assert [p > 0 for p in distribution(tied, top_k=2)] == [True, False, True, False]
    assert distribution(logits, top_k=5) == pytest.approx(torch.softmax(logits, -1)[0].tolist(), abs=1e-6)


def test_temperature_then_top_k_then_top_p():
    probs = [0.4, 0.3, 0.2, 0.1]
    # top_k=3 -> 0.4, 0.3, 0.2 renormalised: 4/9, 3/9, 2/9; top_p=0.7: mass before 2/9 is 7/9 >= 0.7.
    assert distribution(log(probs), top_k=3, top_p=0.7) == pytest.approx([4 / 7, 3 / 7, 0, 0], abs=1e-6)
    # Temperature 2 flattens first: p_i^(1/2) normalised, then top_p over those.
    sq = [math.sqrt(p) for p in probs]
    flat = [s / sum(sq) for s in sq]  # 0.326, 0.282, 0.230, 0.163 (rounded)
    assert distribution(log(probs), temperature=2.0) == pytest.approx(flat, abs=1e-6)
    # Mass before each: 0, 0.326, 0.607, 0.837: top_p=0.65 keeps three, top_p=0.6 two.
    kept = sum(flat[:3])
    assert distribution(log(probs), temperature=2.0, top_p=0.6)[2] == 0
    assert distribution(log(probs), temperature=2.0, top_p=0.65) == pytest.approx(
        [flat[0] / kept, flat[1] / kept, flat[2] / kept, 0], abs=1e-6)


def test_draws_follow_the_filtered_distribution():
    probs = [0.05, 0.5, 0.1, 0.2, 0.15]
    expected = [0, 0.5 / 0.85, 0, 0.2 / 0.85, 0.15 / 0.85]
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_next(log(probs).expand(n, -1), top_p=0.75, generator=gen)
    counts = torch.bincount(draws, minlength=5).tolist()
    assert counts[0] == counts[2] == 0  # never a token outside the nucleus
    for count, p in zip(counts, expected, strict=True):
        assert abs(count / n - p) < 0.01  # 4 standard errors at n = 40,000


def test_temperature_zero_is_the_argmax_and_bad_settings_are_refused():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 3.0]])
    assert sample_next(logits, temperature=0).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"top_p \(0\) must be None or in \(0, 1\]"):
        sample_next(logits, top_p=0)
    with pytest.raises(ValueError, match=r"top_k \(0\) must be None or an int >= 1"):
        sample_next(logits, top_k=0)
    with pytest.raises(ValueError, match=r"temperature \(-1.0\) must be >= 0"):
        sample_next(logits, temperature=-1.0)
