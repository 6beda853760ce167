"""The expert-health metrics end to end: a short run with install_balancing logs them through
MetricsLogger (metrics.jsonl and TensorBoard), and the report draws the heatmap with the health
marks and the health panels."""

import json

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.transformer import Transformer
from moetrain.train.balancing import install_balancing
from moetrain.train.metrics import MetricsLogger
from moetrain.train.optim import build_optimizer
from moetrain.train.report import write_report


def test_health_metrics_reach_jsonl_tensorboard_and_the_report(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Two MoE blocks; a collapse alarm at every interval (threshold just above balance, no warm-up,
    # no persistence) and experts reported unused after 1 idle step, so every mark is drawn.
    model = Transformer(ModelConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=8),
                        moe=MoEConfig(num_experts=8, top_k=1, expert_hidden_dim=16, router="sigmoid",
                                      router_bias_update_rate=1e-3, balance_interval=1, collapse_threshold=0.15,
                                      collapse_warmup_steps=0, collapse_consecutive_checks=1,
                                      unused_expert_steps=1), seed=0)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    balancer = install_balancing(opt, model)
    logger = MetricsLogger(tmp_path, tensorboard=True)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        model(ids, ids).total_loss.backward()
        opt.step()
        opt.zero_grad()
        logger.log(step, balancer.metrics())
    logger.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for key in ("expert_share", "load_cv", "load_max_over_mean", "max_token_fraction", "routing_entropy",
                "load_entropy", "dropped_fraction", "unused_experts", "num_unused_experts",
                "routing_collapse_alarms", "expert_bias"):
        assert key in records[-1], key
        assert len(records[-1][key]) == 2  # one entry per MoE layer
    assert sum(sum(r["routing_collapse_alarms"]) for r in records) > 0
    assert any(r["unused_experts"][0] or r["unused_experts"][1] for r in records)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars, histograms = set(events.Tags()["scalars"]), set(events.Tags()["histograms"])
    assert {"load_cv/layer0", "routing_entropy/layer1", "num_unused_experts/layer0",
            "routing_collapse_alarms/layer1"} <= scalars
    assert {"expert_share/layer0", "expert_bias/layer1"} <= histograms

    made = {p.name for p in write_report(tmp_path)}
    assert {"expert_load.png", "expert_health.png"} <= made
