"""The MoE layer under a token mask (the classifier's padding): only real tokens are routed and
counted. Reference: the same layer run on the real tokens alone, without a mask."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.models.moe.balance import sequence_load_balancing_loss

B, S, D = 3, 6, 16
LENGTHS = (6, 2, 4)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, S, D, generator=g)
    mask = torch.arange(S).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    return x, mask


@pytest.mark.parametrize("aux_loss_type", ["batch", "sequence"])
def test_only_real_tokens_are_routed_and_counted(aux_loss_type):
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, num_shared_experts=1,
                                  aux_loss_coef=0.1, z_loss_coef=0.01, aux_loss_type=aux_loss_type))
    layer.track_routing_stats = True
    x, mask = _inputs()
    out, aux = layer(x, mask)
    assert int(layer.step_local_stats[3]) == sum(LENGTHS)  # STAT_TOKENS: real tokens only
    assert torch.count_nonzero(out[~mask]) == 0  # padded positions: no expert output at all
    real = x[mask]  # [N, D], sequence by sequence
    want, want_aux = layer._forward(real)
    torch.testing.assert_close(out[mask], want, rtol=0, atol=0)
    assert int(aux.num_routed_per_expert.sum()) == sum(LENGTHS) * 2
    assert aux.num_routed == sum(LENGTHS) * 2
    torch.testing.assert_close(aux.z_loss, want_aux.z_loss)
    if aux_loss_type == "batch":
        torch.testing.assert_close(aux.load_balancing, want_aux.load_balancing)
    else:
        # The mean over sequences of each sequence's term over its own real tokens.
        per_sequence = []
        for seq in torch.split(real, list(LENGTHS)):
            routing = layer.router(seq)
            per_sequence.append(sequence_load_balancing_loss(routing.probs_TE.unsqueeze(0),
                                                             routing.idx_TK.unsqueeze(0)))
        torch.testing.assert_close(aux.load_balancing, torch.stack(per_sequence).mean())


def test_capacity_routes_every_position_and_bad_masks_are_named():
    layer = MoELayer(D, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, capacity_factor=2.0))
    x, mask = _inputs()
    _, aux = layer(x, mask)
    assert aux.num_routed == B * S * 2
    plain = MoELayer(D, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8))
    with pytest.raises(ValueError, match=r"token_mask \(torch.bool \[3, 5\]\) must be a bool tensor"):
        plain(x, mask[:, :5])
