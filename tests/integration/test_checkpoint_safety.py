"""Loading a checkpoint never runs code from it.

Each crafted checkpoint carries a pickle payload whose unpickling creates a marker folder, in a
place an attacker would put it: the RNG entry as DCP bytes, DCP's pickled ``.metadata`` index, the
trainer entry's data, a checkpoint of the pickling format 1. Every load is refused with a clear
error (or, for ``.metadata``, which moetrain never opens, succeeds), and the marker never appears.
The payload itself is shown to be live first, so a test that passes is not one whose payload
could not have fired.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from moetrain.train.checkpoint.files import MANIFEST, CheckpointError, file_record
from moetrain.train.checkpoint.index import INDEX, index_to_json, load_model_weights, text_tensor
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.rng_state import capture_rng_state, restore_rng_state

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this creates ``marker``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _genuine(tmp_path: Path) -> Path:
    model, optimizer = _model_and_optimizer(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        return save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer,
                               trainer_state={"step": 1})


def _rewrite(path: Path, *, trainer, rng, entries: dict | None = None, storage_offsets: dict | None = None,
             manifest_format: str | None = None) -> None:
    """Replace the data of checkpoint ``path`` with a DCP save of the given entries (objects are
    pickled by DCP as bytes entries), write the JSON index an attacker would write (tensor entries
    as moetrain writes them, ``entries`` on top, ``storage_offsets`` moved) and a matching manifest."""
    model, optimizer = _model_and_optimizer(0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"],
                                          "param_groups": text_tensor(json.dumps(optim_sd["param_groups"]))},
             "trainer": trainer, "rng": {"rank0": rng}}
    for f in path.glob("*.distcp"):
        f.unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    tensors = Metadata(state_dict_metadata={k: v for k, v in metadata.state_dict_metadata.items()
                                            if isinstance(v, TensorStorageMetadata)},
                       planner_data=metadata.planner_data, storage_data=metadata.storage_data,
                       version=metadata.version)
    index = index_to_json(tensors)
    index["entries"].update(entries or {})
    for row in index["storage"]:
        row[1] = (storage_offsets or {}).get(row[0], row[1])
    (path / INDEX).write_text(json.dumps(index))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = {f.name: file_record(f) for f in sorted(path.iterdir()) if f.name != MANIFEST}
    if manifest_format is not None:
        manifest["format"] = manifest_format
        (path / INDEX).unlink()
        del manifest["files"][INDEX]
    (path / MANIFEST).write_text(json.dumps(manifest))


def _load_both_ways(path: Path) -> list[str]:
    """The errors of ``load_checkpoint`` and ``load_model_weights`` on ``path`` (None: loaded)."""
    model, optimizer = _model_and_optimizer(1)
    before = model.weight.detach().clone()
    errors = []
    for load in (lambda: load_checkpoint(path, model=model, optimizer=optimizer),
                 lambda: load_model_weights(path)):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
                load()
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
            assert torch.equal(model.weight, before)  # a refused load changes nothing
    return errors


def test_the_payload_is_live(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.is_dir()


def test_rng_entry_as_pickled_bytes_is_refused(tmp_path):
    path, marker = _genuine(tmp_path), tmp_path / "ran"
    _rewrite(path, trainer=text_tensor('{"step": 1}'), rng=pickle.dumps(Payload(marker)),
             entries={"rng.rank0": {"kind": "bytes"}})
    for error in _load_both_ways(path):
        assert error is not None and "entry 'rng.rank0' is stored as 'bytes', not as a tensor" in error
    assert not marker.exists()


def test_trainer_entry_holding_a_pickle_is_refused(tmp_path):
    # The index calls the trainer entry a uint8 tensor; its data is DCP's pickle of the payload.
    path, marker = _genuine(tmp_path), tmp_path / "ran"
    _rewrite(path, trainer=Payload(marker), rng=capture_rng_state(), storage_offsets={"trainer": [0]})
    index = json.loads((path / INDEX).read_text())
    length = next(row[5] for row in index["storage"] if row[0] == "trainer")
    index["entries"]["trainer"] = {"kind": "tensor", "dtype": "uint8", "requires_grad": False,
                                   "pin_memory": False, "size": [length], "chunks": [[[0], [length]]]}
    (path / INDEX).write_text(json.dumps(index))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][INDEX] = file_record(path / INDEX)
    (path / MANIFEST).write_text(json.dumps(manifest))
    for error in _load_both_ways(path):
        # DCP reads tensor data with torch.load(weights_only=True), which rejects the payload's global.
        assert error is not None and "reading checkpoint" in error and "Weights only load failed" in error
    assert not marker.exists()


def test_pickled_dcp_metadata_is_never_opened(tmp_path):
    path, marker = _genuine(tmp_path), tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][".metadata"] = file_record(path / ".metadata")
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert _load_both_ways(path) == [None, None]  # the JSON index is all moetrain reads
    assert not marker.exists()


def test_pickling_format_1_is_refused_as_unsafe(tmp_path):
    path, marker = _genuine(tmp_path), tmp_path / "ran"
    _rewrite(path, trainer='{"step": 1}', rng=pickle.dumps(Payload(marker)), manifest_format="moetrain-dcp/1")
    for error in _load_both_ways(path):
        assert error is not None and "format moetrain-dcp/1" in error and "cannot be loaded safely" in error
    assert not marker.exists()


def test_malformed_index_is_a_checkpoint_error(tmp_path):
    path = _genuine(tmp_path)
    index = json.loads((path / INDEX).read_text())
    index["storage"][0][3] = "../elsewhere.distcp"
    (path / INDEX).write_text(json.dumps(index))
    for error in _load_both_ways(path):  # verify=True: the changed index no longer matches its hash
        assert error is not None and "corrupt or partial: file index.json has" in error
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][INDEX] = file_record(path / INDEX)
    (path / MANIFEST).write_text(json.dumps(manifest))
    for error in _load_both_ways(path):
        assert error is not None and "names file '../elsewhere.distcp', which is not a file of the" in error


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, how):
    # A real file beside the checkpoint, with its true size and hash: only the path rule refuses it.
    path = _genuine(tmp_path)
    outside = path.parent / "x"
    outside.write_bytes(b"not a file of the checkpoint")
    name = "../x" if how == "relative" else str(outside)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = file_record(outside)
    (path / MANIFEST).write_text(json.dumps(manifest))
    for error in _load_both_ways(path):  # a refused load leaves the model as it was
        assert error is not None and (f"{MANIFEST} names file {name!r}, which is not a file of the checkpoint "
                                      "folder") in error


def test_rng_state_round_trips_exactly_through_a_checkpoint(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian in both generators
    np.random.standard_normal()
    state = capture_rng_state()
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    want = (random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(3), torch.rand(3))
    model, optimizer = _model_and_optimizer(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        path = save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer,
                               trainer_state={"step": 1}, rng_state=state)
        loaded = load_checkpoint(path, model=model, optimizer=optimizer)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(loaded.rng_state)
    got = (random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(3), torch.rand(3))
    assert got[:2] == want[:2]
    assert np.array_equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert isinstance(optimizer.param_groups[0]["betas"], tuple)  # JSON lists back to the live type


def test_moetrain_never_unpickles():
    """No pickle-family import in moetrain, and every ``torch.load`` passes ``weights_only=True``."""
    unsafe_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
    found = []
    for file in sorted((ROOT / "moetrain").rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{file.relative_to(ROOT)}: import {n}" for n in names if n.split(".")[0] in unsafe_modules]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    found.append(f"{file.relative_to(ROOT)}:{node.lineno}: torch.load without weights_only=True")
    assert not found, found
