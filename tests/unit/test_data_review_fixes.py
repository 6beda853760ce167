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
