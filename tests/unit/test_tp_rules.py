"""What tensor parallelism cannot split is one rule (``config.model.tensor_parallel_errors``): the
job refuses it, the planner's tp row gives it as its reason, and the check on the built model
says the same words, so a layout is never accepted in one place and refused in another."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import DataConfig, JobConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moetrain.config.model import tensor_parallel_errors
from moetrain.distributed.tensor_parallel import check_tensor_parallel
from moetrain.models.transformer import Transformer
from moetrain.plan.model_states import param_specs
from moetrain.plan.tensor_parallel import tp_choices

MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8)


def _model(**fields) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 512, "dim": 24, "num_layers": 2, "num_heads": 3, "max_seq_len": 8,
                          "moe_every": 2, "qk_norm": "full", "dense_hidden_dim": 30, "tie_embeddings": False,
                          **fields})


def _refusals(model: ModelConfig, tp: int) -> tuple[str, str, str]:
    with pytest.raises(ValueError) as job:
        JobConfig(model=model, moe=MOE, train=TrainConfig(global_batch_size=8, micro_batch_size=2),
                  data=DataConfig(seq_len=8, vocab_size=512), parallel=ParallelConfig(tp=tp, ep=1))
    with torch.device("meta"):
        built = Transformer(model, moe=MOE if model.is_moe else None)
    with pytest.raises(ValueError) as module:
        check_tensor_parallel(built, tp)
    row = tp_choices(param_specs(model, MOE), model, per_node=tp, micro_batch_size=2, seq_len=8, grad_accum=1,
                     compute_bytes=4)[-1]
    assert row.tp == tp and not row.valid
    return str(job.value), str(module.value), row.reason


def test_every_part_tp_cannot_split_is_named_the_same_everywhere():
    model = _model()
    job, module, plan = _refusals(model, 4)
    assert job == module == plan == "; ".join(tensor_parallel_errors(model, 4))
    for part in ("parallel.tp (4) must divide model.num_heads (3) and the key/value heads (3)",
                 "model.qk_norm ('full') normalises across all heads",
                 "parallel.tp (4) must divide the dense FFN hidden dim (30, model.dense_hidden_dim)"):
        assert part in job, part


def test_latent_attention_and_the_classifier_head_are_refused():
    errors = tensor_parallel_errors(_model(attention="mla", num_heads=4, qk_norm="none", dense_hidden_dim=32,
                                           head="classifier", num_classes=3), 2)
    assert [e.split(" ", 1)[0] for e in errors] == ["model.head", "model.attention"]


def test_a_model_without_dense_blocks_has_no_dense_ffn_to_split():
    # Every block MoE: the dense hidden dim is never built, so it does not have to divide tp.
    model = _model(moe_every=1, num_heads=4, qk_norm="head")
    assert tensor_parallel_errors(model, 4) == []
    with torch.device("meta"):
        check_tensor_parallel(Transformer(model, moe=MOE), 4)
    assert tensor_parallel_errors(_model(num_heads=4, qk_norm="head"), 4) == [
        "parallel.tp (4) must divide the dense FFN hidden dim (30, model.dense_hidden_dim)"]
    assert tensor_parallel_errors(_model(), 1) == []


@pytest.mark.parametrize("fields, moe, words", [
    ({"mtp_depth": 1}, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, capacity_factor=1.25),
     "moe.capacity_factor (1.25) must be null with model.mtp_depth > 0 and parallel.tp > 1"),
    ({"mtp_depth": 4}, MOE, "model.mtp_depth (4) must be < data.seq_len / parallel.tp (4)")])
def test_the_planner_refuses_what_the_job_refuses_with_multi_token_prediction(fields, moe, words):
    # The rules on the MoE settings and the sequence length: the planner's tp row must not offer a
    # layout that the job then refuses.
    model = _model(num_heads=4, qk_norm="head", dense_hidden_dim=32, **fields)
    with pytest.raises(ValueError, match=r"^" + words.replace("(", r"\(").replace(")", r"\)")):
        JobConfig(model=model, moe=moe, train=TrainConfig(global_batch_size=8, micro_batch_size=2),
                  data=DataConfig(seq_len=8, vocab_size=512), parallel=ParallelConfig(tp=2, ep=1))
    one, two = tp_choices(param_specs(model, moe), model, per_node=2, micro_batch_size=2, seq_len=8, grad_accum=1,
                          compute_bytes=4, moe=moe)
    assert one.valid and not two.valid and words in two.reason
