"""Several data sources mixed by weight: the mixing order (hand-worked), proportions, rank sharding,
resume (bit-equal batches, also at another data-parallel size), per-file validation tails, shards,
one shared vocabulary, the document-mask separator and the config rules.

Loader tests use token streams whose values identify their window: in source s, file f, the token
at offset o is ``s * 1_000_000 + f * 100_000 + o``; so a batch row tells its source, file and window.
"""

import json
import random
import warnings

import numpy as np
import pytest
import torch

from moetrain.config.data import DataConfig, DataSource
from moetrain.data.documents import Documents
from moetrain.data.mixture import MixtureLoader
from moetrain.data.prepare import PreparedData, prepare_data
from moetrain.data.sources import MixedData
from moetrain.data.tokenizer import train_bpe
from moetrain.data.tokens import open_token_file, write_token_file, write_token_shards

S = 4


@pytest.fixture(autouse=True)
def private_default_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "default-cache"))


def streams(file_lengths):
    """Per source, per file, a uint32 stream whose tokens encode (source, file, offset)."""
    return [[np.arange(n, dtype=np.uint32) + s * 1_000_000 + f * 100_000 for f, n in enumerate(lengths)]
            for s, lengths in enumerate(file_lengths)]


def make(file_lengths=((41,), (41,)), weights=(1.0, 1.0), **kw):
    kw.setdefault("seq_len", S)
    kw.setdefault("global_batch_size", 4)
    return MixtureLoader(streams(file_lengths), weights, names=[f"src{i}" for i in range(len(weights))], **kw)


def decode(input_ids_BS):
    """(source, file, window) of each row: windows start at offsets that are multiples of S."""
    first = input_ids_BS[:, 0].tolist()
    return [(t // 1_000_000, t % 1_000_000 // 100_000, t % 100_000 // S) for t in first]


def test_mixing_order_follows_the_worked_example():
    # Weights (3, 1): keys (k + 1/2) / w; ties (1/2, 3/2) go to source 0.
    loader = make(((4 * 40 + 1,), (4 * 40 + 1,)), (3.0, 1.0), global_batch_size=8)
    rows = decode(loader.next_batch()[0])
    assert [s for s, _, _ in rows] == [0, 0, 1, 0, 0, 0, 1, 0]
    rows = decode(loader.next_batch()[0])
    assert [s for s, _, _ in rows] == [0, 0, 1, 0, 0, 0, 1, 0]
    assert loader.state_dict()["consumed"] == [12, 4]


def test_batch_shapes_and_label_shift():
    input_ids, labels = make(global_batch_size=6, dp_size=2).next_batch()
    assert input_ids.shape == labels.shape == (3, S) and input_ids.dtype == labels.dtype == torch.int64
    assert torch.equal(input_ids[:, 1:], labels[:, :-1])
    assert torch.equal(labels[:, -1], input_ids[:, -1] + 1)  # consecutive tokens of one file


def test_proportions_stay_within_one_sample_of_the_quota_and_no_step_repeats_a_window():
    sizes = (4 * 13 + 1, 4 * 29 + 1, 4 * 7 + 1)  # 13, 29 and 7 windows
    weights = (0.5, 0.3, 0.2)
    loader = make(tuple((n,) for n in sizes), weights, global_batch_size=10, seed=3)
    seen: list[list[list[int]]] = [[], [], []]  # per source, per step, its windows
    for step in range(1, 61):
        rows = decode(loader.next_batch()[0])
        assert len(set(rows)) == len(rows), (step, rows)
        for s in range(3):
            seen[s].append([w for source, _, w in rows if source == s])
        consumed = np.array(loader.state_dict()["consumed"])
        quota = step * 10 * np.array(weights)
        assert np.abs(consumed - quota).max() < 1.0, (step, consumed, quota)
    for s, num in enumerate((13, 29, 7)):
        # An epoch is whole steps: the steps whose windows do not repeat one the epoch gave. It is a
        # prefix of a permutation that is another one each epoch, and it leaves out fewer windows
        # than the step that starts the next epoch takes (the rule of TokenLoader: W mod G).
        epochs, current = [], []
        for windows in seen[s]:
            if set(windows) & set(current):
                epochs.append((current, len(windows)))
                current = []
            current = current + windows
        assert len(epochs) >= 2 and epochs[0][0] != epochs[1][0][:len(epochs[0][0])]
        for windows, next_step in epochs:
            assert len(set(windows)) == len(windows) and num - next_step < len(windows) <= num


def test_a_step_never_holds_a_window_twice_and_one_source_drops_what_token_loader_drops():
    # One source of two files, 40 windows, G = 16 on 4 ranks: every epoch gives 2 steps of 32
    # windows, the first 32 of that epoch's permutation, and drops the other 8 (40 mod 16).
    for seed in range(6):
        ranks = [make(((S * 20 + 1, S * 20 + 1),), (1.0,), global_batch_size=16, dp_size=4, dp_rank=r, seed=seed)
                 for r in range(4)]
        for epoch in range(3):
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0, epoch])))
            expected = rng.permutation(40)[:32].tolist()
            got = [f * 20 + w for _ in range(2) for rank in ranks for _, f, w in decode(rank.next_batch()[0])]
            assert got == expected, (seed, epoch)
    # Several sources whose epochs end in the middle of steps, at several dp sizes (the probe's case).
    kw = {"file_lengths": ((S * 9 + 1, S * 5 + 1), (S * 11 + 1,), (S * 6 + 1,)), "weights": (2.0, 1.0, 0.6),
          "global_batch_size": 12}
    for seed in range(4):
        single = make(**kw, seed=seed)
        ranks = [make(**kw, seed=seed, dp_size=3, dp_rank=r, micro_steps=2) for r in range(3)]
        for _ in range(40):
            rows = decode(single.next_batch()[0])
            assert len(set(rows)) == len(rows) == 12, rows
            parts = [[rank.next_batch()[0] for _ in range(2)] for rank in ranks]
            assert decode(torch.cat([parts[r][j] for j in range(2) for r in range(3)])) == rows


@pytest.mark.parametrize(("dp_size", "micro_steps"), [(2, 1), (4, 1), (2, 2)])
def test_rank_batches_concatenate_to_the_single_process_step(dp_size, micro_steps):
    kw = {"file_lengths": ((4 * 9 + 1, 4 * 5 + 1), (4 * 11 + 1,)), "weights": (2.0, 1.0), "global_batch_size": 8,
              "seed": 5}
    single = make(**kw)
    ranks = [make(**kw, dp_size=dp_size, dp_rank=r, micro_steps=micro_steps) for r in range(dp_size)]
    for _ in range(12):  # several epochs of both sources
        expected = single.next_batch()[0]
        # Micro-batch j of every rank, in rank order, then micro-batch j + 1: the one-process batch.
        got = torch.cat([torch.cat([rank.next_batch()[0] for rank in ranks]) for _ in range(micro_steps)])
        assert torch.equal(got, expected)


def test_windows_never_span_two_files_and_every_file_window_is_read():
    # Source 0 has files of 3 and 2 windows (13 and 9 tokens: the last tokens are no window).
    loader = make(((13, 9), (4 * 3 + 1,)), (1.0, 1.0), global_batch_size=2, seed=0)
    rows = [row for _ in range(5) for row in decode(loader.next_batch()[0]) if row[0] == 0]
    assert sorted(rows) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1)]


def test_resume_gives_the_same_batches_bit_for_bit_across_epochs_and_dp_sizes():
    kw = {"file_lengths": ((4 * 6 + 1, 4 * 4 + 1), (4 * 3 + 1,), (4 * 17 + 1,)), "weights": (1.0, 0.5, 2.5),
              "global_batch_size": 8, "seed": 11}
    reference = make(**kw)
    batches = [reference.next_batch() for _ in range(20)]
    saved = make(**kw)
    for _ in range(7):
        saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))  # as stored in a checkpoint
    resumed = make(**kw)
    resumed.load_state_dict(state)
    for x, y in batches[7:]:
        got_x, got_y = resumed.next_batch()
        assert torch.equal(got_x, x) and torch.equal(got_y, y)
    # Two ranks of two micro-batches each resume the same global batches.
    ranks = [make(**kw, dp_size=2, dp_rank=r, micro_steps=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    for x, _ in batches[7:]:
        parts = [[rank.next_batch()[0] for _ in range(2)] for rank in ranks]
        assert torch.equal(torch.cat([parts[0][0], parts[1][0], parts[0][1], parts[1][1]]), x)


def test_a_state_inside_a_step_resumes_only_at_the_same_accumulation():
    kw = {"global_batch_size": 8, "seed": 2}
    run = make(**kw, micro_steps=2)
    run.next_batch()
    state = run.state_dict()
    expected = run.next_batch()[0]
    again = make(**kw, micro_steps=2)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch()[0], expected)
    with pytest.raises(ValueError, match="saved in the middle of a step"):
        make(**kw, micro_steps=4).load_state_dict(state)


def test_resume_rejects_other_sources_weights_or_seed():
    state = make(seed=1).state_dict()
    with pytest.raises(ValueError, match=r"saved sources .* differs"):
        make(weights=(1.0, 2.0), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved sources .* differs"):
        make(file_lengths=((41,), (45,)), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved seed \(1\) differs from this run's \(2\)"):
        make(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"consumed \(\[1, 0\]\) must be 2 ints"):
        make(seed=1).load_state_dict({**state, "consumed": [1, 0]})


def test_unshuffled_epoch_is_maximal_without_a_repeated_window():
    sizes = (4 * 10 + 1, 4 * 3 + 1)
    for weights in [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0), (0.7, 0.3)]:
        val = make(tuple((n,) for n in sizes), weights, global_batch_size=2, shuffle=False)
        rows = [row for _ in range(len(val)) for row in decode(val.next_batch()[0])]
        assert len(rows) == len(val) * 2 and len(set(rows)) == len(rows)
        # One more step of the same mixture would repeat a window.
        longer = make(tuple((n,) for n in sizes), weights, global_batch_size=2, shuffle=True)
        consumed = np.zeros(2, dtype=np.int64)
        for _ in range(len(val) + 1):
            consumed += np.bincount(longer._next_samples(consumed)[0], minlength=2)
        assert (consumed > np.array([10, 3])).any(), weights


def test_eval_samples_are_the_mixing_order_up_to_the_first_repeat_at_any_batch():
    sizes = ((4 * 10 + 1,), (4 * 3 + 1,))
    for weights in [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0), (0.7, 0.3)]:
        source_N, window_N = make(sizes, weights, global_batch_size=2, shuffle=False).eval_samples()
        # The training mixing order (one long step), cut before its first repeated window.
        train = make(sizes, weights, global_batch_size=2, shuffle=True)
        consumed, order_S, k_S = np.zeros(2, dtype=np.int64), [], []
        for _ in range(13):  # 26 samples: past the 13 windows of both sources
            source_G, k_G = train._next_samples(consumed)
            consumed += np.bincount(source_G, minlength=2)
            order_S += source_G.tolist()
            k_S += k_G.tolist()
        first_repeat = next(i for i, (s, k) in enumerate(zip(order_S, k_S, strict=True)) if k >= (10, 3)[s])
        assert list(zip(source_N, window_N, strict=True)) == list(zip(order_S, k_S, strict=True))[:first_repeat]
        for gbs, dp in [(4, 2), (4, 4), (2, 1)]:
            rows = [list(make(sizes, weights, global_batch_size=gbs, dp_rank=r, dp_size=dp, shuffle=False)
                         .eval_batches()) for r in range(dp)]
            seen = [(s, w) for step in zip(*rows, strict=True) for x, _, valid in step
                    for (s, _, w), v in zip(decode(x), valid.tolist(), strict=True) if v]
            assert seen == list(zip(source_N.tolist(), window_N.tolist(), strict=True)), (weights, gbs, dp)


def test_a_source_too_small_for_its_share_is_named():
    with pytest.raises(ValueError, match="data source 'src1' has 3 tokens in 1 file"):
        make(((41,), (3,)))
    with pytest.raises(ValueError, match=r"smaller than its share of one global batch of 8 .*'src1': 1 windows"):
        make(((41,), (5,)), global_batch_size=8)
    val = make(((41,), (5,)), global_batch_size=8, name="val", shuffle=False)  # evaluates: a window is enough
    with pytest.raises(ValueError, match=r"smaller than its share .* only evaluates: eval_batches"):
        val.next_batch()


# --- preparing sources ----------------------------------------------------------------------------

WORDS = ["thou", "art", "the", "king", "queen", "night", "love", "sword", "hence", "good", "lord"]


def write_docs(folder, num_docs, seed, *, jsonl=False):
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(num_docs)]
    if jsonl:
        (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    else:
        for i, d in enumerate(docs):
            (folder / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    return docs


def sources_cfg(tmp_path, sources, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("val_fraction", 0.1)
    kw.setdefault("vocab_size", 300)
    return DataConfig(corpus="path", sources=sources, cache_dir=str(tmp_path / "cache"), **kw)


def test_text_sources_share_one_bpe_and_hold_out_the_tail_of_each_file(tmp_path):
    docs_a = write_docs(tmp_path / "a", 30, 0)
    docs_b = write_docs(tmp_path / "b", 20, 1, jsonl=True)
    cfg = sources_cfg(tmp_path, [{"path": str(tmp_path / "a"), "weight": 2}, {"path": str(tmp_path / "b")}])
    data = prepare_data(cfg)
    assert isinstance(data, MixedData) and data.vocab_size == 300 and data.eos_id == 0
    for source, docs in zip(data.sources, (docs_a, docs_b), strict=True):
        tokens, meta = open_token_file(source.files[0])
        assert meta["tokenizer"] == data.tokenizer.key
        # Every document followed by eos, in path order.
        pieces = np.split(np.asarray(tokens, dtype=np.int64), np.flatnonzero(tokens == 0) + 1)[:-1]
        assert [data.tokenizer.decode(p[:-1]) for p in pieces] == docs
        num_val = round(len(tokens) * 0.1)
        assert len(source.val[0]) == num_val and np.array_equal(source.val[0], tokens[len(tokens) - num_val:])
        assert np.array_equal(source.train[0], tokens[:len(tokens) - num_val])
        assert isinstance(source.train[0], np.memmap)
    assert [s.weight for s in data.sources] == [2.0, 1.0]
    # The BPE was trained on both sources: a word only source b has becomes one token.
    x, y = data.train_loader(global_batch_size=6, seed=0).next_batch()
    assert x.shape == (6, 16) and torch.equal(x[:, 1:], y[:, :-1])
    val = data.val_loader(global_batch_size=6)
    assert len(list(val.eval_batches())) >= len(val) >= 1


def test_the_shared_bpe_is_trained_on_a_weighted_sample_of_the_text_sources(tmp_path, monkeypatch):
    write_docs(tmp_path / "a", 30, 0)
    write_docs(tmp_path / "b", 30, 1)
    from moetrain.data import sources as sources_module

    trained_on = []
    real = sources_module.build_tokenizer

    def spy(kind, documents, **kw):
        trained_on.append(list(documents))
        return real(kind, documents, **kw)

    monkeypatch.setattr(sources_module, "build_tokenizer", spy)
    monkeypatch.setattr(sources_module, "BPE_SAMPLE_CHARS", 2000)
    prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a"), "weight": 3},
                                        {"path": str(tmp_path / "b"), "weight": 1}]))
    sample = trained_on[0]
    a_docs = list(Documents(sorted((tmp_path / "a").glob("*.txt")), label="a"))
    b_docs = list(Documents(sorted((tmp_path / "b").glob("*.txt")), label="b"))
    num_a = next(i for i in range(1, 31) if sum(map(len, a_docs[:i])) >= 1500)
    num_b = next(i for i in range(1, 31) if sum(map(len, b_docs[:i])) >= 500)
    assert sample == a_docs[:num_a] + b_docs[:num_b]


def test_shard_sources_are_mapped_and_checked_against_the_text_tokenizer(tmp_path):
    write_docs(tmp_path / "a", 20, 0)
    bpe = train_bpe(Documents(sorted((tmp_path / "a").glob("*.txt")), label="a"), vocab_size=300)
    docs_b = [" ".join(random.Random(i).choice(WORDS) for _ in range(40)) for i in range(30)]
    shards = write_token_shards(docs_b, bpe, tmp_path / "b", shard_tokens=200)
    assert len(shards) >= 3
    streams_b = [open_token_file(p)[0] for p in shards]
    for stream in streams_b:  # cut between documents: every shard ends with eos
        assert stream[-1] == bpe.eos_id
    decoded = [bpe.decode(p[:-1]) for s in streams_b
               for p in np.split(np.asarray(s, dtype=np.int64), np.flatnonzero(s == bpe.eos_id) + 1)[:-1]]
    assert decoded == docs_b
    # Shards only: vocabulary from the sidecars.
    with pytest.warns(UserWarning, match="ignored for pre-tokenised data"):
        data = prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "b")}]))
    assert data.vocab_size == 300 and data.eos_id == bpe.eos_id and data.tokenizer is None
    assert len(data.sources[0].train) == len(shards)
    for stream, train, val in zip(streams_b, data.sources[0].train, data.sources[0].val, strict=True):
        assert np.array_equal(np.concatenate([train, val]), stream) and len(val) == round(len(stream) * 0.1)
    # A data.path folder of several shards is one such source.
    with pytest.warns(UserWarning):
        one = prepare_data(DataConfig(corpus="path", path=str(tmp_path / "b"), seq_len=16, val_fraction=0.1))
    assert isinstance(one, MixedData) and [s.name for s in one.sources] == [str(tmp_path / "b")]
    # Text next to shards of another tokeniser: refused, naming both sides.
    with pytest.raises(ValueError, match=r"share one vocabulary: tokenizer is 'bpe' for .*shard-00000.bin but "
                                         r"'bpe300-[0-9a-f]+' for the text sources' tokeniser"):
        prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}]))


def test_text_and_shards_of_the_same_tokenizer_mix(tmp_path):
    from moetrain.data.tokenizer import ByteTokenizer

    docs_a = write_docs(tmp_path / "a", 10, 0)
    docs_b = [" ".join(random.Random(i).choice(WORDS) for _ in range(40)).upper() for i in range(10)]
    write_token_shards(docs_b, ByteTokenizer(), tmp_path / "b", shard_tokens=500)
    data = prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}],
                                    tokenizer="bytes"))
    assert data.vocab_size == 256 and data.eos_id is None and data.tokenizer.key == "bytes"
    text = [bytes(np.concatenate([t, v]).astype(np.uint8)).decode() for t, v in zip(data.sources[0].train,
                                                                                   data.sources[0].val, strict=True)]
    shards = [bytes(np.concatenate([t, v]).astype(np.uint8)).decode() for t, v in zip(data.sources[1].train,
                                                                                     data.sources[1].val, strict=True)]
    assert text == ["".join(d + "\n" for d in docs_a)] and "".join(shards) == "".join(d + "\n" for d in docs_b)
    # Source a is lower case, source b upper case: both are drawn, about half and half.
    x, _ = data.train_loader(global_batch_size=8, seed=0).next_batch()
    from_b = [bytes(row.numpy().astype(np.uint8)).decode().isupper() for row in x]
    assert from_b.count(True) == 4


def test_shards_of_different_vocabularies_are_refused(tmp_path):
    for name, vocab in (("a", 500), ("b", 600)):
        (tmp_path / name).mkdir()
        write_token_file(tmp_path / name / "x.bin", [np.arange(100)], vocab_size=vocab, eos_id=0)
    with pytest.raises(ValueError, match=r"vocab_size is 500 for .*a/x.bin but 600 for .*b/x.bin"):
        prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}]))


def test_a_missing_source_path_is_named(tmp_path):
    write_docs(tmp_path / "a", 5, 0)
    with pytest.raises(ValueError, match=r"data.sources\[1\].path \('.*nowhere'\) does not exist"):
        prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "nowhere")}]))


def test_document_mask_resolves_the_separator_or_names_what_has_no_eos(tmp_path):
    write_docs(tmp_path / "a", 20, 0)
    data = prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}], document_mask=True))
    assert data.document_separator == data.eos_id == 0
    assert prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}])).document_separator is None
    single = prepare_data(DataConfig(corpus="path", path=str(tmp_path / "a"), seq_len=16, vocab_size=300,
                                     document_mask=True, cache_dir=str(tmp_path / "cache")))
    assert isinstance(single, PreparedData) and single.document_separator == single.eos_id == 0
    with pytest.raises(ValueError, match=r"data.document_mask \(True\) needs an end-of-text id .* data.path"):
        prepare_data(DataConfig(corpus="path", path=str(tmp_path / "a"), tokenizer="bytes", seq_len=16,
                                document_mask=True, cache_dir=str(tmp_path / "cache")))
    (tmp_path / "bin").mkdir()
    write_token_file(tmp_path / "bin" / "x.bin", [np.arange(100)], vocab_size=300)  # no eos_id
    with pytest.raises(ValueError, match=r"data.document_mask \(True\) needs an end-of-text id"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "bin")}], document_mask=True))


def test_config_rules_name_the_field():
    ok = DataConfig(corpus="path", sources=[{"path": "a", "weight": 2}, DataSource(path="b")])
    assert ok.sources == (DataSource("a", 2), DataSource("b", 1.0))
    cases = [
        ({"sources": [{"path": "a"}]}, r"data.sources \(\['a'\]\) needs data.corpus=\"path\""),
        ({"corpus": "path", "path": "x", "sources": [{"path": "a"}]}, r"data.path \('x'\) must be null"),
        ({"corpus": "path", "sources": []}, r"data.sources \(\[\]\) must be a non-empty list"),
        ({"corpus": "path", "sources": [{"path": "a", "weight": 0}]}, r"data.sources\[0\].weight \(0\) must be"),
        ({"corpus": "path", "sources": [{"path": "a", "weight": float("inf")}]}, r"data.sources\[0\].weight"),
        ({"corpus": "path", "sources": [{"path": "a", "size": 1}]}, r"data.sources\[0\] .* unknown keys \['size'\]"),
        ({"corpus": "path", "sources": [{"path": ""}]}, r"data.sources\[0\].path \(''\) must be a non-empty"),
        ({"corpus": "path", "sources": [{"path": "a"}, {"path": "a"}]}, r"lists \['a'\] more than once"),
        ({"tokenizer": "sentencepiece"}, r"data.tokenizer \('sentencepiece'\) must be 'bpe', 'bytes' or"),
        ({"document_mask": 1}, r"data.document_mask \(1\) must be true or false"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            DataConfig(**kwargs)
    assert DataConfig(tokenizer="models/gpt2/tokenizer.json").tokenizer.endswith(".json")


def test_sources_load_from_yaml_and_save_back(tmp_path):
    from moetrain.config.loader import load_config, save_config

    path = tmp_path / "job.yaml"
    path.write_text("data:\n  corpus: path\n  sources:\n    - {path: web, weight: 3}\n    - path: books\n")
    cfg = load_config(path, ["--data.document_mask=true"])
    assert cfg.data.sources == (DataSource("web", 3.0), DataSource("books", 1.0)) and cfg.data.document_mask
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg
    override = load_config(None, ["--data.corpus=path", "--data.sources=[{path: a, weight: 0.25}]"])
    assert override.data.sources == (DataSource("a", 0.25),)
    with pytest.raises(ValueError, match=r"data.sources\[0\].weight \('x'\) must be a number"):
        load_config(None, ["--data.corpus=path", "--data.sources=[{path: a, weight: x}]"])


def test_packed_documents_from_the_loader_do_not_see_each_other_through_the_transformer(tmp_path):
    from moetrain.config.model import ModelConfig
    from moetrain.models.transformer import Transformer

    write_docs(tmp_path / "a", 40, 0)
    write_docs(tmp_path / "b", 40, 1, jsonl=True)
    data = prepare_data(sources_cfg(tmp_path, [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}],
                                    seq_len=64, document_mask=True))
    eos = data.document_separator
    x, _ = data.train_loader(global_batch_size=8, seed=0).next_batch()
    # A row with a whole document inside it: [..., eos | doc k ..., eos | later tokens ...].
    row = next(r for r in x if len(torch.nonzero(r[:-1] == eos)) >= 2)
    first, second = torch.nonzero(row[:-1] == eos).flatten()[:2].tolist()
    changed = row.clone()
    doc = slice(first + 1, second)  # doc k, its eos at `second` kept: positions stay put
    changed[doc] = (changed[doc] + 7) % (data.vocab_size - 1) + 1  # other ids, never eos (id 0)
    assert eos not in changed[doc] and not torch.equal(changed, row)
    batch = torch.stack([row, changed])

    def logits(separator):
        config = ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=4, max_seq_len=64, moe_every=0,
                             vocab_size=data.vocab_size, document_separator=separator)
        with torch.no_grad():
            return Transformer(config, seed=0)(batch).logits

    masked = logits(eos)
    later = slice(second + 1, None)
    assert torch.equal(masked[0, later], masked[1, later])  # later documents: bit-identical
    assert torch.equal(masked[0, :first + 1], masked[1, :first + 1])  # earlier ones (causality)
    assert not torch.equal(masked[0, doc], masked[1, doc])
    unmasked = logits(None)  # the control: without the mask the later tokens see doc k
    assert not torch.equal(unmasked[0, later], unmasked[1, later])
