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
