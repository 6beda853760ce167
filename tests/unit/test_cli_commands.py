"""The command line's shape and its small commands, in process: every subcommand is dispatched
through ``set_defaults(func=...)`` to a function of its own module of ``moetrain.cli``, only the
job commands take ``--section.field=value`` overrides, and ``moetrain export --max-shard-size``
writes shards with an index that read back to the same tensors."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.cli import build_parser, main
from moetrain.interop.export import read_export, write_export

# A minimal valid argument list of every subcommand (the parser's required arguments only).
COMMANDS = {
    "train": [], "demo": [], "config": ["show"], "plan": ["--nproc", "2"], "data": ["list"],
    "export": ["RUN", "--to", "OUT"], "convert": [], "upcycle": ["--from-hf", "D", "--num-experts", "4",
                                                                 "--top-k", "2", "--to", "OUT"],
    "experts": ["grow", "RUN", "--num-experts", "8", "--to", "OUT"], "generate": ["RUN", "--prompt", "x"],
    "eval": ["RUN"], "compare": ["A", "B"], "report": ["RUN"],
    "launch": ["slurm", "--nodes", "1", "--gpus-per-node", "1"], "verify": ["--config", "X"],
}
JOB_COMMANDS = {"train", "demo", "config", "plan", "launch", "verify"}


def test_every_subcommand_dispatches_to_its_own_module():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "cmd")
    assert set(subparsers.choices) == set(COMMANDS)
    for cmd, rest in COMMANDS.items():
        args = parser.parse_args([cmd, *rest])
        module = args.func.__module__
        assert module.startswith("moetrain.cli.") and module != "moetrain.cli.launch", (cmd, module)
        assert args.takes_overrides == (cmd in JOB_COMMANDS), cmd


@pytest.mark.parametrize("argv", [["report", "RUN", "--train.steps=3"], ["data", "list", "--x.y=1"],
                                  ["train", "--steps=3"]])
def test_overrides_where_a_command_takes_none_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"unrecognised arguments: {argv[-1]}" in capsys.readouterr().err


def test_export_max_shard_size_writes_shards_that_read_back(tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(64, 64, generator=gen) for i in range(4)}  # 16 KiB each
    write_export(tmp_path / "src", config={}, state_dict=state)

    assert main(["export", str(tmp_path / "src"), "--to", str(tmp_path / "one")]) == 0
    assert "(model.safetensors, config.yaml)" in capsys.readouterr().out
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()

    assert main(["export", str(tmp_path / "src"), "--to", str(tmp_path / "sharded"), "--max-shard-size", "40KB"]) == 0
    assert "(2 safetensors shards, model.safetensors.index.json, config.yaml)" in capsys.readouterr().out
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]
    _, back, _ = read_export(tmp_path / "sharded")
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_export_refuses_a_size_that_is_not_one(tmp_path, capsys):
    write_export(tmp_path / "src", config={}, state_dict={"w": torch.zeros(2)})
    assert main(["export", str(tmp_path / "src"), "--to", str(tmp_path / "o"), "--max-shard-size", "lots"]) == 2
    assert ("moetrain: error: --max-shard-size ('lots') must be a positive size such as 5GB, 500MiB or 1000000"
            in capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
