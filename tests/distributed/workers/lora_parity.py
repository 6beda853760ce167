"""LoRA fine-tuning under expert parallelism against one plain process: the same transformer
(attention, a dense FFN block, an MoE block with shared experts), adapters on every target, the
same global batch. The ranks shard the experts and their adapters over ``ep``; the reference
holds everything. Compared: the loss of every step, every adapter gradient (expert adapters
reassembled by global expert index), every adapter after the last AdamW step, and that no base
weight moved anywhere.

Shape legend: B sequences per rank, S sequence length, W ranks.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.finetune import FinetuneConfig
from moetrain.distributed import ParallelDims, is_expert_shard, parallelize
from moetrain.distributed.data_parallel.ddp import wrap_optimizer
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.models.lora import apply_lora, is_lora_name
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer

VOCAB, SEQ, SEQS_PER_RANK, STEPS = 32, 8, 2, 3
FINETUNE = FinetuneConfig(lora_rank=4, lora_alpha=8.0, lora_targets=("attention", "experts", "shared_experts",
                                                                       "dense_ffn"))
MAX_NORM = 0.05
"""Below every step's adapter-gradient norm here, so clipping acts on both sides."""


def build_lora_model(seed: int = 0) -> Transformer:
    model_cfg = ModelConfig(dim=16, num_heads=2, num_layers=2, vocab_size=VOCAB, dense_layers=(0,),
                            activation="swiglu", max_seq_len=SEQ)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, num_shared_experts=1, activation="swiglu")
    model = Transformer(model_cfg, moe=moe, seed=seed)
    return apply_lora(model, FINETUNE, seed=seed + 1)


def make_batches(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[STEPS, W*B, S]`` ids and labels; rank r owns rows r*B:(r+1)*B."""
    g = torch.Generator().manual_seed(123)
    shape = (STEPS, world_size * SEQS_PER_RANK, SEQ)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def _state(model, dims: ParallelDims | None, *, grads: bool) -> dict:
    """name -> (global expert offset or None, local tensor), adapters only (grads) or everything."""
    out = {}
    for name, p in model.named_parameters():
        if grads and not is_lora_name(name):
            assert p.grad is None, f"frozen {name} has a gradient"
            continue
        t = p.grad if grads else p
        if is_expert_shard(p):
            local = t.to_local()
            out[name] = (dims.ep_rank * local.shape[0], local.detach().clone())
        else:
            out[name] = (None, t.detach().clone())
    return out


def train(model, train_model, ids, labels, dims: ParallelDims | None, *, zero_stage: int = 0) -> dict:
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    if dims is not None:
        opt = wrap_optimizer(opt, dims, zero_stage=zero_stage)
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = train_model(ids[s], labels[s])
        out.total_loss.backward()
        norm = clip_global_grad_norm_(trainable, MAX_NORM)
        steps.append({"loss": out.total_loss.item(), "norm": norm.item(), "grads": _state(model, dims, grads=True)})
        opt.step()
    return {"steps": steps, "params": _state(model, dims, grads=False)}


def run_reference(world_size: int) -> dict:
    model = build_lora_model()
    ids, labels = make_batches(world_size)
    return train(model, model, ids, labels, None)


def lora_worker(rank: int, world_size: int, ep: int, zero_stage: int, checkpoint: str | None = None) -> dict:
    dims = ParallelDims(world_size=world_size, ep=ep, num_experts=4)
    dims.build_mesh()
    model = build_lora_model()
    train_model = parallelize(model, dims, zero_stage=zero_stage)
    ids, labels = make_batches(world_size)
    rows = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    result = train(model, train_model, ids[:, rows], labels[:, rows], dims, zero_stage=zero_stage)
    if checkpoint is not None:
        dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    return result
