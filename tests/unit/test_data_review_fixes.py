"""Data-layer defects found by review: each test failed before its fix."""

import io
import json

import pytest

from moetrain.data.inputs import BadInputError, Input, _jsonl_records, _ZstdFrames


def _lines(n: int, tag: str = "doc") -> list[bytes]:
    return [json.dumps({"text": f"{tag} {i} " * (i % 7 + 1)}).encode() + b"\n" for i in range(n)]


def _frames(lines: list[bytes], per_frame: int) -> list[bytes]:
    import zstandard

    c = zstandard.ZstdCompressor()
    return [c.compress(b"".join(lines[i:i + per_frame])) for i in range(0, len(lines), per_frame)]


@pytest.mark.parametrize("chunk", [7, 1 << 16])
def test_every_zstd_frame_is_read_whatever_the_input_chunk(tmp_path, chunk):
    import zstandard

    blob = b"".join(_frames(_lines(300), 100))
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(blob)
    reference = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()
    with io.BufferedReader(_ZstdFrames(path, chunk=chunk)) as f:
        assert f.read() == reference
    got = [line for line, _ in _jsonl_records(Input(path, "jsonl.zst"), 0)]
    assert got == reference.rstrip(b"\n").split(b"\n")


@pytest.mark.parametrize("cut", ["between lines", "inside a line"])
def test_a_truncated_zst_stops_with_an_error_naming_the_file(tmp_path, cut):
    frames = _frames(_lines(300), 100)
    blob = b"".join(frames)
    # 10 bytes into the third frame, or halfway through the whole (a single-frame file cut anywhere)
    end = len(frames[0]) + len(frames[1]) + 10 if cut == "between lines" else len(blob) // 2
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(blob[:end])
    with pytest.raises(BadInputError, match=r"cut\.jsonl\.zst: cannot be read after line \d+ \(EOFError"):
        list(_jsonl_records(Input(path, "jsonl.zst"), 0))


def test_a_corrupt_zst_is_named(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(b"not a zstd frame at all")
    with pytest.raises(BadInputError, match=r"bad\.jsonl\.zst: cannot be read after line 0"):
        list(_jsonl_records(Input(path, "jsonl.zst"), 0))


def test_a_prepare_killed_once_its_first_shard_is_published_is_unfinished_and_resumes(tmp_path):
    """SIGKILL-like death (os._exit in a forked child) at the first progress save that finds a
    published shard: before the fix no progress.json existed yet, so training took the one shard
    for the whole corpus and a rerun refused the folder."""
    import os

    from moetrain.config.data import DataConfig
    from moetrain.data import prepare_corpus as pc
    from moetrain.data.prepare import prepare_data

    inp = tmp_path / "b.jsonl"
    inp.write_bytes(b"".join(_lines(50)))
    out, reference = tmp_path / "killed", tmp_path / "reference"

    def options(where):
        return pc.PrepareOptions(out_dir=where, tokenizer="bytes", num_workers=0, shard_docs=20)

    real_save = pc.Progress.save
    pid = os.fork()
    if pid == 0:  # the child dies where a kill would: right after the first shard's rename
        def save(self, where):
            if any(where.glob("shard-*.bin")):
                os._exit(9)
            real_save(self, where)
        pc.Progress.save = save  # type: ignore[method-assign]
        try:
            pc.prepare_corpus([inp], options(out), log=lambda m: None)
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 9
    assert sorted(p.name for p in out.glob("shard-*.bin")) == ["shard-00000-00000.bin"]
    with pytest.raises(ValueError, match="unfinished `moetrain data prepare` output"):
        prepare_data(DataConfig(corpus="path", path=str(out), seq_len=8))
    pc.prepare_corpus([inp], options(out), log=lambda m: None)
    pc.prepare_corpus([inp], options(reference), log=lambda m: None)
    names = sorted(p.name for p in reference.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert "progress.json" not in names and len([n for n in names if n.endswith(".bin")]) == 3
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_a_prepare_that_stopped_before_its_first_shard_starts_again_with_the_corrected_command(tmp_path):
    """Bad input (or a wrong --field) stops the first run before any shard: its progress.json holds
    nothing to continue, so the rerun on the corrected file starts again in the same folder and
    writes what a clean run writes."""
    from moetrain.data import prepare_corpus as pc
    from moetrain.data.inputs import BadInputError

    inp, out, reference = tmp_path / "c.jsonl", tmp_path / "out", tmp_path / "reference"
    good = b"".join(_lines(30))
    inp.write_bytes(b"{not json\n" + good)
    options = {"tokenizer": "bytes", "num_workers": 0, "shard_docs": 20}
    with pytest.raises(BadInputError, match="not valid JSON"):
        pc.prepare_corpus([inp], pc.PrepareOptions(out_dir=out, **options), log=lambda m: None)
    assert (out / "progress.json").is_file() and not any(out.glob("shard-*.bin"))
    inp.write_bytes(good)  # the bad line deleted: another size and time, the identity changes
    pc.prepare_corpus([inp], pc.PrepareOptions(out_dir=out, **options), log=lambda m: None)
    pc.prepare_corpus([inp], pc.PrepareOptions(out_dir=reference, **options), log=lambda m: None)
    names = sorted(p.name for p in reference.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert len([n for n in names if n.endswith(".bin")]) == 2
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def _reference_mixing_order(num_windows, weights):
    """(source, window) of the mixing order up to the first repeat, by exact keys (k + 1/2) / w_s,
    ties to the lower source: the rule of moetrain.data.mixture, computed without it."""
    from fractions import Fraction

    keyed = sorted(((Fraction(2 * k + 1, 2) / Fraction(w), s, k) for s, (num, w) in
                    enumerate(zip(num_windows, weights, strict=True)) for k in range(num + 1)))
    out = []
    for _, s, k in keyed:
        if k == num_windows[s]:
            return out
        out.append((s, k))
    return out


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_validation_loaders_evaluate_the_same_windows_at_every_dp_size(micro_batch_size):
    """build_loaders makes the validation batch micro_batch_size * dp: a split of fewer windows than
    that was refused at dp 4 though eval_batches pads a partial batch and evaluates it at dp 1."""
    import numpy as np

    from moetrain.data.loader import TokenLoader
    from moetrain.data.mixture import MixtureLoader

    seq = 16
    stream = np.arange(6 * seq + 1, dtype=np.uint32)  # 6 windows; window w starts with token w * seq
    sources = [[np.arange(20 * seq + 1, dtype=np.uint32)], [np.arange(3 * seq + 1, dtype=np.uint32) + 100_000]]
    expected_mix = _reference_mixing_order([20, 3], [1.0, 1.0])
    for dp in (1, 2, 4):
        g = micro_batch_size * dp
        token_loaders = [TokenLoader(stream, seq_len=seq, global_batch_size=g, dp_rank=r, dp_size=dp,
                                     shuffle=False, name="val") for r in range(dp)]
        mix_loaders = [MixtureLoader(sources, [1.0, 1.0], names=["a", "b"], seq_len=seq, global_batch_size=g,
                                     dp_rank=r, dp_size=dp, shuffle=False, name="val") for r in range(dp)]
        for loaders, expected in ((token_loaders, [(0, w) for w in range(6)]), (mix_loaders, expected_mix)):
            seen = []
            for step in zip(*(list(loader.eval_batches()) for loader in loaders), strict=True):
                for x, _, valid in step:  # ranks in order: the global batch's rows in order
                    seen += [(int(t) // 100_000, int(t) % 100_000 // seq) for t in x[valid][:, 0]]
            assert seen == expected, (dp, micro_batch_size)
        if g > len(expected_mix):  # the first step would reach a repeat: these loaders only evaluate
            with pytest.raises(ValueError, match="only evaluates"):
                mix_loaders[0].next_batch()
        if g > 6:
            with pytest.raises(ValueError, match="only evaluates"):
                token_loaders[0].next_batch()
    with pytest.raises(ValueError, match="not one window"):
        TokenLoader(stream[:seq], seq_len=seq, global_batch_size=4, shuffle=False, name="val")
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        TokenLoader(stream, seq_len=seq, global_batch_size=8)


def _mixture(num_windows, weights, global_batch_size, seq=2, **kw):
    """Source s's window k starts with token 1000 * s + k (so a batch row tells its window)."""
    import numpy as np

    from moetrain.data.mixture import MixtureLoader

    files = [[np.concatenate([np.repeat(np.arange(num) + 1000 * s, seq), [0]])] for s, num in enumerate(num_windows)]
    return MixtureLoader(files, weights, names=[f"src{s}" for s in range(len(weights))], seq_len=seq,
                         global_batch_size=global_batch_size, **kw)


def _reference_step_draws(num_windows, weights, global_batch_size, num_steps):
    """Windows drawn from each source by each step, from the exact mixing order (no loader code)."""
    from fractions import Fraction

    need = global_batch_size * num_steps
    keyed = sorted((Fraction(2 * k + 1, 2) / Fraction(w), s) for s, w in enumerate(weights)
                   for k in range(int(need * Fraction(w) / sum(Fraction(x) for x in weights)) + 2))[:need]
    return [[sum(1 for _, s in keyed[i:i + global_batch_size] if s == t) for t in range(len(weights))]
            for i in range(0, need, global_batch_size)]


def test_a_mixture_whose_step_would_repeat_a_window_is_refused_naming_the_source():
    # Source src2's mean share of a step is 8 / 10.75 * 3 = 2.23 of its 2 windows: some steps draw 3.
    draws = _reference_step_draws([11, 12, 2], [1.75, 1.0, 8.0], 3, 43)
    assert max(d[2] for d in draws) == 3 and draws[0][2] == 2  # the first step alone passed the old check
    with pytest.raises(ValueError, match=r"'src2' has 2 windows, and a step of 3 sequences draws 3 windows from "
                                         r"it \(its share per step is 0.744 \* 3 = 2.23\)"):
        _mixture([11, 12, 2], [1.75, 1.0, 8.0], 3)
    # Equal weights, a share of exactly W per step: never more in one step, accepted.
    assert max(d[0] for d in _reference_step_draws([2, 100], [1.0, 1.0], 4, 50)) == 2
    _mixture([2, 100], [1.0, 1.0], 4)


def test_accepted_mixtures_never_repeat_a_window_in_a_step_and_refusals_are_real():
    """Random small mixtures: an accepted one gives distinct windows in every step over several
    epochs of its smallest source (read back from the batches); a refused one with weights of
    small ratio (where the check is exact) has a step that draws more windows than its source has."""
    import numpy as np

    rng = np.random.default_rng(3)
    accepted = refused = 0
    for trial in range(150):
        n, g = int(rng.integers(1, 4)), int(rng.integers(1, 11))
        num_windows = [int(rng.integers(1, 13)) for _ in range(n)]
        weights = [float(rng.integers(1, 9)) / 2 for _ in range(n)]
        try:
            loader = _mixture(num_windows, weights, g, seed=trial)
        except ValueError as e:
            if "smaller than its share of one global batch" in str(e):
                continue
            refused += 1
            draws = _reference_step_draws(num_windows, weights, g, 120)
            assert any(d[t] > num_windows[t] for d in draws for t in range(n)), (num_windows, weights, g, str(e))
            continue
        accepted += 1
        for _ in range(int(3 * max(num_windows) * sum(weights) / min(weights) / g) + 2):
            first = loader.next_batch()[0][:, 0].tolist()
            assert len(set(first)) == len(first), (num_windows, weights, g, first)
    assert accepted > 50 and refused > 5, (accepted, refused)


JSONL_CASES = {  # bytes of a .jsonl -> its texts, or the line of the error; one rule for both readers
    "plain": (b'{"text": "a"}\n\n{"text": "b\\r\\nc"}\n  \n', ["a", "b\r\nc"]),
    "crlf": (b'{"text": "a"}\r\n{"text": "b"}\r\n', ["a", "b"]),
    "bom": (b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n', ["first", "second"]),
    "bom later": (b'{"text": "first"}\n\xef\xbb\xbf{"text": "second"}\n', 2),
    "cr only": (b'{"text": "one"}\r{"text": "two"}\r', 1),
    "cr inside": (b'{"text":\r "one"}\n', ["one"]),
    "raw u2028 and nel": ('{"text": "x\u2028y"}\n{"text": "p\x85q"}\n'.encode(), ["x\u2028y", "p\x85q"]),
    "not utf-8": (b'{"text": "ok"}\n{"text": "\xff"}\n', 2),
}


@pytest.mark.parametrize("case", list(JSONL_CASES))
def test_data_path_and_prepare_read_a_jsonl_alike(tmp_path, case):
    """data.path read .jsonl in text mode (universal newlines, a BOM an error) and prepare in bytes
    (lines at b"\\n", a BOM accepted on any line): the same file gave other records or an error."""
    from moetrain.data.documents import Documents
    from moetrain.data.inputs import parse_record

    content, expected = JSONL_CASES[case]
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    if isinstance(expected, int):
        error = rf"in\.jsonl:{expected} is not valid JSON"
        with pytest.raises(ValueError, match=error):
            list(Documents([path], label="x"))
        with pytest.raises(BadInputError, match=error):
            [parse_record(line, where, "text") for line, where in _jsonl_records(Input(path, "jsonl"), 0)]
        return
    assert list(Documents([path], label="x")) == expected
    assert [parse_record(line, where, "text") for line, where in _jsonl_records(Input(path, "jsonl"), 0)] == expected


def test_a_jsonl_with_a_bom_gives_the_same_tokens_prepared_and_in_data_path(tmp_path):
    import numpy as np

    from moetrain.data.documents import Documents
    from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus
    from moetrain.data.tokenizer import ByteTokenizer
    from moetrain.data.tokens import load_or_build_tokens, open_token_file

    path = tmp_path / "in.jsonl"
    path.write_bytes(JSONL_CASES["bom"][0])
    prepare_corpus([path], PrepareOptions(out_dir=tmp_path / "out", tokenizer="bytes", num_workers=0),
                   log=lambda m: None)
    prepared = np.concatenate([open_token_file(p)[0] for p in sorted((tmp_path / "out").glob("*.bin"))])
    cached = load_or_build_tokens(Documents([path], label="x"), ByteTokenizer(), cache_dir=tmp_path / "cache")[0]
    assert bytes(np.asarray(prepared, dtype=np.uint8)) == bytes(np.asarray(cached, dtype=np.uint8)) == \
        b"first\nsecond\n"


@pytest.mark.parametrize("sidecar, match", [
    ("[1, 2]", r"t\.bin\.json holds a JSON list \(\[1, 2\]\); it must be an object"),
    ('{"dtype": "uint16", "vocab_size": 300, "eos_id": "0"}', r"t\.bin\.json: eos_id \('0'\) must be null or an int "
                                                             r"in \[0, vocab_size=300\)"),
    ('{"dtype": "uint16", "vocab_size": 300, "eos_id": 300}', r"eos_id \(300\) must be null or an int in \[0, "),
    ('{"dtype": "uint16", "vocab_size": 300, "eos_id": true}', r"eos_id \(True\) must be null or an int"),
    ('{"dtype": "uint16", "vocab_size": 300, "num_tokens": "11"}', r"num_tokens \('11'\) must be an int, the number "
                                                                  r"of tokens in t\.bin \(11\)"),
])
def test_a_bad_token_file_sidecar_is_named(tmp_path, sidecar, match):
    import numpy as np

    from moetrain.data.tokens import open_token_file

    np.arange(11, dtype="<u2").tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text(sidecar)
    with pytest.raises(ValueError, match=match):
        open_token_file(tmp_path / "t.bin")


def test_a_bad_megatron_sidecar_or_a_short_index_is_named(tmp_path):
    import numpy as np

    from moetrain.data.megatron import INDEX_HEADER, write_index
    from moetrain.data.tokens import open_token_file

    np.arange(10, dtype="<u2").tofile(tmp_path / "m.bin")
    write_index(tmp_path / "m.idx", dtype=np.dtype("<u2"), sequence_lengths=np.array([6, 4]))
    side = tmp_path / "m.bin.json"
    for sidecar, match in [("[1]", r"m\.bin\.json holds a JSON list \(\[1\]\); it must be an object"),
                           ('{"vocab_size": 300, "eos_id": "x"}', r"m\.bin\.json: eos_id \('x'\) must be null or an"),
                           ('{"vocab_size": 300, "eos_id": -1}', r"eos_id \(-1\) must be null or an int in \[0, ")]:
        side.write_text(sidecar)
        with pytest.raises(ValueError, match=match):
            open_token_file(tmp_path / "m.bin")
    side.write_text('{"vocab_size": 300, "eos_id": 299}')
    assert open_token_file(tmp_path / "m.bin")[1]["eos_id"] == 299
    whole = (tmp_path / "m.idx").read_bytes()
    for cut in (20, len(INDEX_HEADER), 0):  # a cut inside the header is a truncation, not another format
        (tmp_path / "m.idx").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=rf"m\.idx has {cut} bytes, fewer than the 34 of a Megatron index's "
                                             "header: truncated"):
            open_token_file(tmp_path / "m.bin")


def test_prepare_names_its_own_vocab_size_option(tmp_path):
    from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus

    (tmp_path / "a.jsonl").write_bytes(b"".join(_lines(5)))
    with pytest.raises(ValueError, match=r"^--vocab-size \(0\) must be an int >= 257"):
        prepare_corpus([tmp_path / "a.jsonl"], PrepareOptions(out_dir=tmp_path / "out", vocab_size=0),
                       log=lambda m: None)
