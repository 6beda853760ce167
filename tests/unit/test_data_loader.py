"""TokenLoader: shapes, determinism, rank sharding (the union property), epochs and resume.

The token stream is ``arange(N)``, so a window is identified by its first input token: window w
starts with token w * S. That makes disjointness and coverage checks exact.
"""

import numpy as np
import pytest
import torch

from moetrain.data.loader import TokenLoader

S = 8


def make_loader(num_tokens=8 * 50 + 1, **kw):
    kw.setdefault("seq_len", S)
    kw.setdefault("global_batch_size", 4)
    return TokenLoader(np.arange(num_tokens, dtype=np.uint32), **kw)


def window_ids(input_ids_BS):
    return (input_ids_BS[:, 0] // S).tolist()


def test_batch_shapes_dtypes_and_label_shift():
    loader = make_loader(global_batch_size=6, dp_size=2)
    input_ids, labels = loader.next_batch()
    assert input_ids.shape == labels.shape == (3, S)
    assert input_ids.dtype == labels.dtype == torch.int64
    # labels are the inputs shifted by one token, and each row is a contiguous slice of the stream
    assert torch.equal(labels[:, :-1], input_ids[:, 1:])
    assert torch.equal(labels[:, -1], input_ids[:, -1] + 1)
    assert torch.equal(input_ids, input_ids[:, :1] + torch.arange(S))
    assert all(w * S == row[0] for w, row in zip(window_ids(input_ids), input_ids.tolist(), strict=True))


def test_same_seed_same_batches_other_seed_other_order():
    a, b, c = make_loader(seed=3), make_loader(seed=3), make_loader(seed=4)
    batches_a = [a.next_batch()[0] for _ in range(5)]
    batches_b = [b.next_batch()[0] for _ in range(5)]
    batches_c = [c.next_batch()[0] for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(batches_a, batches_c, strict=True))


def test_epoch_visits_each_window_once_then_reshuffles():
    loader = make_loader(num_tokens=8 * 50 + 1, global_batch_size=4)  # 50 windows -> 12 steps, 2 dropped
    assert loader.num_windows == 50 and len(loader) == 12
    epoch0 = [w for _ in range(12) for w in window_ids(loader.next_batch()[0])]
    assert loader.epoch == 1 and loader.step == 0
    epoch1 = [w for _ in range(12) for w in window_ids(loader.next_batch()[0])]
    assert len(set(epoch0)) == len(set(epoch1)) == 48
    assert set(epoch0) <= set(range(50)) and set(epoch1) <= set(range(50))
    assert epoch0 != epoch1  # a new permutation each epoch, not a replay


@pytest.mark.parametrize("dp_size", [2, 4])
def test_rank_batches_are_disjoint_and_concatenate_to_the_single_process_batch(dp_size):
    single = make_loader(global_batch_size=8, seed=11)
    ranks = [make_loader(global_batch_size=8, seed=11, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(len(single) + 3):  # crosses an epoch boundary
        want_inputs, want_labels = single.next_batch()
        got = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([g[0] for g in got]), want_inputs)
        assert torch.equal(torch.cat([g[1] for g in got]), want_labels)
        ids = [window_ids(g[0]) for g in got]
        assert all(len(i) == 8 // dp_size for i in ids)
        assert len({w for rank_ids in ids for w in rank_ids}) == 8  # no window on two ranks


def test_resume_gives_identical_next_batches_across_an_epoch_boundary():
    first = make_loader(seed=5, dp_rank=1, dp_size=2)
    for _ in range(len(first) - 2):
        first.next_batch()
    state = first.state_dict()
    expected = [first.next_batch() for _ in range(5)]

    fresh = make_loader(seed=5, dp_rank=1, dp_size=2)
    fresh.load_state_dict(state)
    got = [fresh.next_batch() for _ in range(5)]
    for (x0, y0), (x1, y1) in zip(expected, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_resume_under_another_dp_size_continues_the_same_global_batches():
    single = make_loader(global_batch_size=8, seed=2)
    for _ in range(3):
        single.next_batch()
    state = single.state_dict()
    ranks = [make_loader(global_batch_size=8, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(torch.cat([loader.next_batch()[0] for loader in ranks]), single.next_batch()[0])


def test_resume_rejects_a_state_from_other_data_or_seed():
    state = make_loader(seed=1).state_dict()
    with pytest.raises(ValueError, match=r"saved seed \(1\) differs"):
        make_loader(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved num_windows"):
        make_loader(num_tokens=8 * 60 + 1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="step"):
        make_loader(seed=1).load_state_dict({**state, "step": 10_000})


def test_eval_batches_repeat_and_leave_the_position_alone():
    val = make_loader(shuffle=False, global_batch_size=4, dp_rank=0, dp_size=2)
    first = [x for x, _, _ in val.eval_batches(12)]
    second = [x for x, _, _ in val.eval_batches(12)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)) and len(first) == 3
    assert window_ids(first[0]) == [0, 1] and window_ids(first[1]) == [4, 5]  # stream order, rank 0 share
    assert val.epoch == 0 and val.step == 0


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_eval_batches_cover_every_window_once_at_any_data_parallel_size(dp_size):
    # 11 windows in batches of 2 per rank: the last global batch is partial at every dp size.
    ranks = [list(make_loader(num_tokens=8 * 11 + 1, shuffle=False, global_batch_size=2 * dp_size, dp_rank=r,
                              dp_size=dp_size).eval_batches()) for r in range(dp_size)]
    assert len({len(batches) for batches in ranks}) == 1  # the same forwards on every rank
    for max_windows, want in [(None, list(range(11))), (5, list(range(5)))]:
        ranks = [list(make_loader(num_tokens=8 * 11 + 1, shuffle=False, global_batch_size=2 * dp_size, dp_rank=r,
                                  dp_size=dp_size).eval_batches(max_windows)) for r in range(dp_size)]
        seen = [w for step in zip(*ranks, strict=True) for x, y, valid in step
                for w, v in zip(window_ids(x), valid.tolist(), strict=True) if v]
        assert seen == want, (dp_size, max_windows)
        x, y, valid = ranks[0][0]
        assert torch.equal(y[:, :-1], x[:, 1:]) and valid.dtype == torch.bool


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch_size": 6, "dp_size": 4}, r"divisible by micro_steps \* dp_size \(1 \* 4\)"),
    ({"global_batch_size": 8, "micro_steps": 3}, r"divisible by micro_steps \* dp_size \(3 \* 1\)"),
    ({"micro_steps": 0}, r"micro_steps \(0\) must be an int >= 1"),
    ({"dp_rank": 2, "dp_size": 2}, r"dp_rank \(2\)"),
    ({"num_tokens": 8 * 3 + 1, "global_batch_size": 4}, "3 windows .* fewer than one global batch"),
    ({"seed": -1}, r"seed \(-1\)"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_loader(**kwargs)


@pytest.mark.parametrize("micro_steps, dp_size", [(2, 1), (2, 2), (4, 2)])
def test_a_step_covers_the_same_global_batch_whatever_the_accumulation_and_dp_size(micro_steps, dp_size):
    single = make_loader(global_batch_size=8, seed=5)  # one micro-batch of 8 per step
    ranks = [make_loader(global_batch_size=8, micro_steps=micro_steps, dp_rank=r, dp_size=dp_size, seed=5)
             for r in range(dp_size)]
    assert ranks[0].local_batch_size == 8 // (micro_steps * dp_size)
    for _ in range(len(single) + 2):  # across an epoch boundary
        # Micro-batch by micro-batch, rank by rank: the single process's batch, in order.
        step = torch.cat([torch.cat([loader.next_batch()[0] for loader in ranks]) for _ in range(micro_steps)])
        assert torch.equal(step, single.next_batch()[0])
    assert ranks[0].epoch == single.epoch and ranks[0].step == single.step


def test_state_between_steps_resumes_at_another_accumulation_and_dp_size():
    saved = make_loader(global_batch_size=8, micro_steps=2, dp_rank=0, dp_size=2, seed=9)
    for _ in range(2 * 3):  # three steps of two micro-batches
        saved.next_batch()
    state = saved.state_dict()
    assert (state["step"], state["micro"]) == (3, 0)
    elastic = make_loader(global_batch_size=8, micro_steps=4, seed=9)  # world 1, accumulation 4
    elastic.load_state_dict(state)
    reference = make_loader(global_batch_size=8, seed=9)
    reference.load_state_dict(state)
    assert torch.equal(torch.cat([elastic.next_batch()[0] for _ in range(4)]), reference.next_batch()[0])


def test_state_inside_a_step_resumes_only_at_the_same_accumulation():
    saved = make_loader(global_batch_size=8, micro_steps=2, seed=9)
    saved.next_batch()
    state = saved.state_dict()
    same = make_loader(global_batch_size=8, micro_steps=2, seed=9)
    same.load_state_dict(state)
    assert torch.equal(same.next_batch()[0], saved.next_batch()[0])
    with pytest.raises(ValueError, match=r"middle of a step \(micro-batch 1 of 2\)"):
        make_loader(global_batch_size=8, micro_steps=4, seed=9).load_state_dict(state)
