"""The router's top-k: topk on a tie-breaking key must select exactly what a stable descending
sort selects (the independent reference), ties and exact zeros included."""

import pytest
import torch

from moetrain.models.moe.router import top_k_lowest_id_first


def _reference(scores_TE, k):
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("num_experts,k", [(8, 2), (64, 8), (128, 6), (200, 4)])
def test_matches_stable_sort_on_random_and_tied_scores(num_experts, k):
    g = torch.Generator().manual_seed(num_experts)
    random_TE = torch.rand(500, num_experts, generator=g)
    coarse_TE = (torch.rand(500, num_experts, generator=g) * 3).floor() / 3  # many exact ties
    zeros_TE = torch.zeros(3, num_experts)
    for scores_TE in (random_TE, coarse_TE, zeros_TE, torch.softmax(random_TE * 30, dim=-1)):
        assert torch.equal(top_k_lowest_id_first(scores_TE, k), _reference(scores_TE, k))


def test_adjacent_fp32_values_keep_their_order():
    one = torch.tensor(1.0)
    below = torch.nextafter(one, torch.tensor(0.0))
    # The highest id holds the larger of two adjacent fp32 values: the tie-break must not flip it.
    scores_TE = torch.zeros(1, 128)
    scores_TE[0, 0], scores_TE[0, 127] = below, one
    assert top_k_lowest_id_first(scores_TE, 2).tolist() == [[127, 0]]
