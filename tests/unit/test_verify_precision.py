"""Low-precision bounds: an fp8 dispatch is recognised by the name the config uses, and the bf16
and fp8 bounds sit between the clean runs' noise and the bugs' signal (docs/verify.md)."""

from __future__ import annotations

from moetrain.config.loader import load_config
from moetrain.verify.checks import Comparison, Precision
from moetrain.verify.driver import Plan, compare_step


def _step(got: dict, want: dict, precision: Precision, *overrides: str) -> Comparison:
    out = Comparison()
    compare_step(out, "", got, want, Plan(load_config("tiny", list(overrides)), [], [], 1), precision, step=1)
    return out


def _rows(out: Comparison) -> dict[str, bool]:
    return {r.quantity.strip(): r.ok for r in out.results}


def test_the_configs_fp8_dispatch_name_is_low_precision():
    fp8 = Precision("fp32", load_config("tiny", ["--moe.dispatch_dtype=fp8_e4m3"]).moe.dispatch_dtype)
    assert fp8.fp8 and fp8.low_precision and fp8.bound("routing") > Precision("bf16").bound("routing")


def test_bf16_aux_loss_bound_catches_a_per_rank_aux_loss():
    # Clean bf16 tiny at ep=2,dp=2 (seeds 1-8, 3 steps): aux loss within 3.0e-4 relative; the Switch
    # loss normalised by the rank's tokens instead of the group's: 1.47e-3.
    want = {"aux_loss": 0.03, "loss": 5.0, "grad_norm": 2.0, "lr": 1e-3}
    bf16 = Precision("bf16")
    assert all(_rows(_step({**want, "aux_loss": 0.03 * (1 + 3.0e-4)}, want, bf16)).values())
    assert not _rows(_step({**want, "aux_loss": 0.03 * (1 + 1.47e-3)}, want, bf16))["aux_loss"]


def test_fp8_bounds_pass_the_clean_noise_and_catch_a_missing_one_over_ep():
    # Clean fp8-dispatch tiny (seeds 1-8): grad norm within 1.8e-3, 19 of 512 copies moved; expert
    # gradients averaged over edp without 1/ep: grad norm 6.8e-2.
    job = ("--moe.num_experts=4", "--data.seq_len=32", "--train.global_batch_size=8", "--train.micro_batch_size=4")
    layers = len(load_config("tiny", list(job)).model.moe_layer_ids)
    want = {"aux_loss": 0.03, "loss": 5.0, "grad_norm": 2.0, "lr": 1e-3, "expert_share": [[0.25] * 4] * layers}
    fp8 = Precision("fp32", "fp8_e4m3")
    routed = 8 * 32 * 2  # tiny at verify's shrink: B S K copies a layer
    moved = [[0.25 + 19 / routed, 0.25 - 19 / routed, 0.25, 0.25]] * layers
    clean = {**want, "grad_norm": 2.0 * (1 + 1.8e-3), "expert_share": moved}
    assert all(_rows(_step(clean, want, fp8, *job)).values())
    assert not _rows(_step({**want, "grad_norm": 2.0 * 1.068}, want, fp8, *job))["grad_norm"]
