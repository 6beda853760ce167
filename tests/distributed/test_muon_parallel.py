"""optim.name "muon" on gloo ranks against one plain process with the same weights and global batch
(workers/muon_parity.py): every step's loss and gradient norm within 1e-5 relative, every parameter
and every Muon momentum (ZeRO-1's consolidated from its slices) within 1e-4, under

* expert parallelism (ep = 2: each rank orthogonalises its own experts, nothing gathered),
* ZeRO-1 (momentum slices gathered into whole matrices; experts over dp at ep = 1, over edp at 4 ranks),
* FSDP2 ZeRO-2/3 (Shard(0) updates redistributed to whole matrices; experts over dp at ep = 1, the
  dense weights at ep = 2, experts over edp on a 2-D mesh at 4 ranks);

and the Trainer at ep = 2, ZeRO-1 resumed from a step-2 checkpoint repeats its losses bit for bit.
(The single-process algorithm against the published one: tests/unit/test_muon.py.)"""

import random

import pytest

from tests.distributed.workers.muon_parity import muon_worker, run_reference, trainer_worker
from tests.distributed.workers.zero_parity import Run, assert_matches, rel_err
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 4


def _check(runs, results, ref) -> None:
    for run in runs:
        assert_matches(run, results, ref, rtol=1e-5, param_rtol=1e-4)
        got = results[0][run.name]["momenta"]
        assert set(got) == set(ref["momenta"]) and len(got) == 12  # attention x 2, dense FFN, experts
        for name, want in ref["momenta"].items():
            assert rel_err(got[name], want) <= 1e-4, (run.name, name)


def test_muon_under_ep_zero1_and_fsdp_equals_one_process():
    ref = run_reference(Run("ref", 0, steps=STEPS))
    two = [Run(f"stage{s}_ep{ep}", s, ep=ep, steps=STEPS) for s, ep in ((0, 2), (1, 1), (1, 2), (2, 1), (3, 2))]
    _check(two, run_ranks(muon_worker, 2, two, timeout_s=200), ref)
    four = [Run(f"4ranks_stage{s}_ep2", s, ep=2, steps=STEPS) for s in (1, 3)]
    _check(four, run_ranks(muon_worker, 4, four, timeout_s=200), ref)


def test_trainer_muon_resumes_exactly_under_ep_and_zero1(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    rng = random.Random(0)
    words = ["thou", "art", "the", "king", "night"]
    (data / "a.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)))
    layout = ["--parallel.ep=2", "--parallel.zero_stage=1", "--train.deterministic=true"]
    first = run_ranks(trainer_worker, 2, tmp_path / "first", data, layout, timeout_s=120)[0]
    step2 = tmp_path / "first" / "checkpoints" / "step_000000002"
    resumed = run_ranks(trainer_worker, 2, tmp_path / "resumed", data, [*layout, f"--checkpoint.resume={step2}"],
                        timeout_s=120)[0]
    assert len(first) == 4 and resumed == first[2:], (first, resumed)
