"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): ``model.mtp_depth`` modules
after the last block, run one after the other, module k predicting token ``t + k + 1`` at position t.

Module k takes the previous depth's hidden state ``h^{k-1}`` at positions ``0 .. S-k-1`` and the
embedding of the tokens ``k`` places ahead (``input_ids[:, k:]``, the shared ``tok_embeddings``):

    h'_t  = eh_proj([hnorm(h^{k-1}_t); enorm(emb(x_{t+k}))])     [2D] -> [D]
    h^k   = norm(block(h'_{0 .. S-k-1}))                        one causal block, the module's own norm
    p_t   = softmax(output(h^k_t))                              the shared head
    L_k   = cross-entropy(p, labels[:, k:])                     labels[t + k] = x_{t+k+1}

``h^0`` is what the main head reads, the final norm's output, and each depth hands on its normed
state: the paper leaves open which side of the norm the state is taken from; this is the side
DeepSeek-V3's checkpoints are served with (Megatron-LM, vLLM at depth 1, and transformers'
``MtpModel``, which tests/unit/test_hf_mtp.py compares against). The sequence gets k positions
shorter at depth k (no position sees past the end), and the rotary positions stay those of the
main sequence. The loss added to the next-token loss is ``model.mtp_loss_weight * mean_k L_k``.
With ``keep_length`` (tensor parallelism sets it: sequence parallelism splits every depth's
sequence over the tp ranks, which S - k positions do not allow) every depth keeps the S positions:
the last k read the first k tokens again (causal attention keeps them from the scored positions),
their labels are ``IGNORE_INDEX`` and the block's MoE layer does not route them (its token mask),
so the losses, the routing counts and the aux losses are those of the S - k positions.
``DeepSeek-V3``'s checkpoints store each module's norm as ``shared_head.norm``, and concatenate
the embedding first: the import swaps ``eh_proj``'s halves. Self-speculative decoding
(``moetrain.train.generation``) runs the modules as a draft model.

Nothing here knows about parallelism: expert parallelism finds the modules' MoE layers like any
other; under pipeline parallelism the modules sit on the last stage with a copy of the embedding
(``moetrain.distributed.pipeline.stages``); tensor parallelism splits them as it splits the
trunk's blocks and sets ``keep_length`` (``moetrain.distributed.tensor_parallel``).

Shape legend: B batch, S sequence, L positions of one depth (S - k; S with ``keep_length``), D model
dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.attention import RMSNorm
from moetrain.models.moe.layer import MoEAux

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One depth: the two norms, the projection of their concatenation, ``block`` (a
    ``TransformerBlock`` built by the caller, MoE or dense) and the norm before the shared head."""

    def __init__(self, dim: int, *, block: nn.Module, norm_eps: float) -> None:
        super().__init__()
        self.hnorm = RMSNorm(dim, eps=norm_eps)
        self.enorm = RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        # It sees S - k positions, the trunk's blocks S: compiled, it gets static graphs of its own
        # (moetrain.distributed.parallelize.compile_dynamic).
        self.block.static_shapes = True  # type: ignore[assignment]
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.keep_length = False
        """Run at the S positions of the main sequence, the last k padded (see the module docstring);
        False: at the S - k positions that have a token k places ahead."""

    def forward(self, h_BSD: torch.Tensor, emb_BSD: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor,
                mask_B1SK: torch.Tensor | None = None, cache=None,
                token_mask_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEAux | None]:
        """``h_BSD``: the previous depth's hidden states; ``emb_BSD``: the embeddings of the tokens
        k places ahead of them; ``cache``: the block's attention cache when decoding;
        ``token_mask_BS``: the positions the block's MoE layer routes (None: all). Returns the
        block's output (``norm`` of it is this depth's hidden state) and its MoE aux (None for a
        dense block)."""
        x_BSD = self.eh_proj(torch.cat([self.hnorm(h_BSD), self.enorm(emb_BSD)], dim=-1))
        return self.block(x_BSD, cos_SP, sin_SP, mask_B1SK, cache, token_mask_BS)


def mtp_losses(modules: nn.ModuleList, h_BSD: torch.Tensor, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, *,
               embed: Callable[[torch.Tensor], torch.Tensor], output: nn.Module, cos_SP: torch.Tensor,
               sin_SP: torch.Tensor, mask_fn: Callable[[torch.Tensor], torch.Tensor | None]
               ) -> tuple[torch.Tensor, list[MoEAux]]:
    """The cross-entropy of every depth, ``[num depths]`` fp32, and the MoE aux of their blocks.

    ``h_BSD``: the main model's final-norm output; ``labels_BS``: the next-token
    labels of the main loss; ``embed`` and ``output``: the model's shared embedding (with its
    dropout) and head; ``cos_SP, sin_SP``: the rotary angles of the S positions; ``mask_fn(ids_BS)``:
    the attention mask of a sequence of those tokens (None = plain causal)."""
    B, S = input_ids_BS.shape
    assert len({cast(MTPModule, m).keep_length for m in modules}) <= 1, "every depth keeps the length, or none"
    losses: list[torch.Tensor] = []
    moe_aux: list[MoEAux] = []
    for k, module in enumerate(modules, start=1):
        assert isinstance(module, MTPModule), type(module)
        num_scored = S - k  # positions with a token k places ahead
        if module.keep_length:
            # The last k positions read the first k tokens again: any id would do, the causal
            # mask keeps them from the scored positions; unrouted, unscored.
            token_mask_BS = (torch.arange(S, device=input_ids_BS.device) < num_scored).expand(B, S)
            x_BLD, aux = module(h_BSD, embed(input_ids_BS.roll(-k, dims=1)), cos_SP, sin_SP,
                                mask_fn(input_ids_BS), token_mask_BS=token_mask_BS)
            labels_BL = F.pad(labels_BS[:, k:], (0, k), value=IGNORE_INDEX)
        else:
            L = num_scored
            x_BLD, aux = module(h_BSD[:, :L], embed(input_ids_BS[:, k:]), cos_SP[:L], sin_SP[:L],
                                mask_fn(input_ids_BS[:, :L]))
            labels_BL = labels_BS[:, k:]
        if aux is not None:
            moe_aux.append(aux)
        h_BSD = module.norm(x_BLD)
        logits_BLV = output(h_BSD)
        # fp32 cross-entropy, as the main loss: the log-softmax over V in bf16 loses small probabilities.
        losses.append(F.cross_entropy(logits_BLV.float().flatten(0, -2), labels_BL.flatten(),
                                      ignore_index=IGNORE_INDEX))
    return torch.stack(losses), moe_aux

