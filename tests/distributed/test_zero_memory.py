"""Measured memory of real gloo ranks at ZeRO stages 0-3 x ep against the planner.

* Model states: the planner's parameter, gradient and optimizer-state bytes equal, byte for byte,
  what ``model_state_bytes`` finds on every rank after a step: replicated (stage 0), element-wise
  optimizer slices (stage 1, with and without the host copy), FSDP2's padded dim-0 shards, empty
  shards, experts sharded over edp on dim 0 or dim 1, HSDP and CPU offload.
* Activations: the estimate within 25% of the peak ``MemoryTracker`` measures on each rank, at
  ep 1 and 2, with DDP and FSDP (measured: within 2%).
* Gathered parameters: the stage-2/3 estimate of FSDP's unsharded parameters within 25% too.
"""

import pytest

from moetrain.plan.activations import estimate_activations
from moetrain.plan.model_states import Layout, param_specs, rank_state_bytes, unsharded_param_peak_bytes
from tests.distributed.workers.zero_parity import Run, model_configs
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Uneven shards everywhere: vocab 70 over 4 ranks (rows 18,18,18,16), a router of 6 rows (2,2,2,0:
# an empty shard), 3 local experts over edp 2 (2,1).
UNEVEN = {"model": {"vocab_size": 70, "dim": 36, "num_heads": 2}, "moe": {"num_experts": 6}}
# One local expert per rank with edp 2: experts shard on dim 1.
DIM1 = {"moe": {"num_experts": 2, "top_k": 1}}
# The tiny preset's shapes (vocab from its tokenizer's 4096), short sequences: for activations.
TINY = {"model": {"vocab_size": 4096, "dim": 128, "num_layers": 4, "num_heads": 4, "max_seq_len": 256,
                  "moe_every": 1}, "moe": {"num_experts": 8, "expert_hidden_dim": 256}, "seq_len": 128}


def _layout(run: Run, world: int) -> Layout:
    return Layout(world=world, ep=run.ep, zero_stage=run.zero_stage, hsdp_replicate=run.hsdp_replicate,
                  offload_optimizer=run.offload_optimizer, offload_params=run.offload_params)


def _check_states(runs, results, world):
    for run in runs:
        specs = param_specs(*model_configs(run))
        for rank in range(world):
            got = results[rank][run.name]["states"]
            planned = rank_state_bytes(specs, _layout(run, world), rank).as_dict()
            # No optim.ema_decay, rebalancing or 1-bit Adam in these runs.
            assert [planned.pop(k) for k in ("average_bytes", "replica_bytes", "residual_bytes")] == [0, 0, 0]
            for key, value in planned.items():
                assert got[key] == value, f"[{run.name}] rank {rank} {key}: measured {got[key]} != planned {value}"


def test_model_state_bytes_exact_world2():
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep, **UNEVEN) for s in (0, 1, 2, 3) for ep in (1, 2)]
    runs += [Run("stage1_offload", 1, ep=2, offload_optimizer=True, **UNEVEN),
             Run("stage3_offload", 3, ep=2, offload_params=True, **UNEVEN)]
    _check_states(runs, run_ranks(_worker, 2, runs, timeout_s=200), 2)


def test_model_state_bytes_exact_world4():
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep, **UNEVEN) for s in (0, 1, 2, 3) for ep in (1, 2)]
    runs += [Run(f"stage{s}_ep4", s, ep=4) for s in (1, 3)]
    runs += [Run(f"stage{s}_dim1", s, ep=2, **DIM1) for s in (1, 2, 3)]
    runs += [Run("stage3_hsdp", 3, ep=2, hsdp_replicate=2, **UNEVEN),
             Run("stage1_offload", 1, ep=2, offload_optimizer=True, **UNEVEN)]
    _check_states(runs, run_ranks(_worker, 4, runs, timeout_s=200), 4)


def test_activation_and_gathered_estimates_world2():
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep, **TINY) for s in (0, 2, 3) for ep in (1, 2)]
    results = run_ranks(_worker, 2, runs, timeout_s=200)
    for run in runs:
        model, moe = model_configs(run)
        est = estimate_activations(model, moe, micro_batch_size=4, seq_len=run.seq_len, ep=run.ep)
        layout = _layout(run, 2)
        specs = param_specs(model, moe)
        for rank in range(2):
            peaks = results[rank][run.name]["peaks"]
            ratio = est.peak_bytes / peaks.activation_peak_bytes
            assert 0.75 <= ratio <= 1.25, f"[{run.name}] rank {rank}: activation estimate / measured = {ratio:.3f}"
            planned_params = rank_state_bytes(specs, layout, rank).param + \
                unsharded_param_peak_bytes(specs, layout, compute_bytes=4)
            ratio = planned_params / peaks.param_bytes
            assert 0.75 <= ratio <= 1.25, f"[{run.name}] rank {rank}: parameter peak planned / measured = {ratio:.3f}"
            # Peaks can only exceed what is at rest.
            assert peaks.grad_bytes >= results[rank][run.name]["states"]["grad_bytes"]
            assert peaks.optim_bytes >= results[rank][run.name]["states"]["optim_bytes"]


def _worker(rank, world_size, runs):
    from tests.distributed.workers.zero_parity import memory_worker

    return memory_worker(rank, world_size, runs)
