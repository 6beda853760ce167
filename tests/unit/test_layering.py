"""Layers point one way: every ``moetrain`` import (module level or inside a function, absolute or
relative) goes to the module's own layer or one below it, never up and never sideways to a
sibling of the same rank; and the config modules import each other without a cycle.

    utils 0 -> config 1 -> data 2, models 2 -> distributed 3 -> train 4 -> interop 5, plan 5 -> verify 6
    -> cli 7

``verify`` runs jobs (train) and reads them back through the exporter (interop), so it sits above both.

The ``moetrain/cli/`` package (one module per subcommand) is the top layer: nothing imports it.
The imports are read with ``ast``; nothing is executed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moetrain"

RANKS = {"utils": 0, "config": 1, "data": 2, "models": 2, "distributed": 3, "train": 4, "interop": 5, "plan": 5,
         "verify": 6, "cli": 7}
"""Layer -> rank. A layer may import layers of lower rank and itself; same-rank siblings not."""


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``moetrain/config/loader.py`` -> ``moetrain.config.loader``; a package's ``__init__.py`` is
    the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """``moetrain.config.loader`` -> ``config``; ``moetrain.cli`` -> ``cli``."""
    parts = module.split(".")
    assert parts[0] == "moetrain", module
    if len(parts) == 1:
        raise AssertionError("the top-level package moetrain/__init__.py must stay empty of imports")
    if parts[1] not in RANKS:
        raise AssertionError(f"{module}: layer {parts[1]!r} has no rank; add it to RANKS in {__file__}")
    return parts[1]


def imported_modules(source: str, module: str, *, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of every moetrain module ``source`` imports, wherever the statement is.

    ``from X import name`` counts as importing ``X.name`` when that is a module in ``known``,
    else ``X``. Relative imports are resolved against ``module``."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "moetrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "moetrain":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if sub in known else target))
    return out


def violations(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports that point up or sideways, one line each."""
    if not imports:
        return []
    own = layer_of(module)
    bad = []
    for line, target in imports:
        if target == "moetrain":
            bad.append(f"{module}:{line} imports the top-level package moetrain")
            continue
        other = layer_of(target)
        if other != own and RANKS[other] >= RANKS[own]:
            kind = "a sibling layer" if RANKS[other] == RANKS[own] else "a layer above"
            bad.append(f"{module}:{line} ({own}, rank {RANKS[own]}) imports {target} "
                       f"({other}, rank {RANKS[other]}): {kind}")
    return bad


def _sources() -> dict[str, tuple[Path, str]]:
    return {module_name(p): (p, p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))}


def _import_graph() -> dict[str, list[tuple[int, str]]]:
    sources = _sources()
    known = set(sources)
    return {name: imported_modules(text, name, is_package=path.name == "__init__.py", known=known)
            for name, (path, text) in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports) as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_every_module_imports_only_its_layer_and_below():
    graph = _import_graph()
    assert len(graph) > 50 and "moetrain.config.loader" in graph  # the walk found the package
    bad = [v for module, imports in graph.items() for v in violations(module, imports)]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_config_modules_import_each_other_without_a_cycle():
    graph = _import_graph()
    config = {m: {t for _, t in imports if t.startswith("moetrain.config")}
              for m, imports in graph.items() if m.startswith("moetrain.config")}
    # The package __init__ re-exports every section: it may import them, none of them imports it.
    back = sorted(m for m, targets in config.items() if "moetrain.config" in targets)
    assert not back, f"config modules importing the package moetrain.config itself: {back}"
    cycle = find_cycle(config)
    assert cycle is None, "import cycle in moetrain.config: " + " -> ".join(cycle)


def test_utils_imports_nothing_else_of_moetrain():
    graph = _import_graph()
    bad = [f"{m}:{line} imports {t}" for m, imports in graph.items() if m.startswith("moetrain.utils")
           for line, t in imports if not t.startswith("moetrain.utils")]
    assert not bad, "\n".join(bad)


# --- the checker itself catches what it is for ------------------------------------------------------

KNOWN = {"moetrain.config", "moetrain.config.loader", "moetrain.config.job", "moetrain.models.presets",
         "moetrain.data", "moetrain.data.registry", "moetrain.train", "moetrain.train.trainer",
         "moetrain.plan", "moetrain.plan.planner", "moetrain.interop", "moetrain.interop.export",
         "moetrain.distributed", "moetrain.distributed.runtime", "moetrain.cli", "moetrain.cli.plan",
         "moetrain.cli.launch"}


@pytest.mark.parametrize("module, source, found", [
    # config reaching up into models, at module level and lazily inside a function
    ("moetrain.config.model", "from moetrain.models.presets import PRESETS\n", "moetrain.models.presets"),
    ("moetrain.config.loader", "def f():\n    from moetrain.models import presets\n", "moetrain.models.presets"),
    ("moetrain.config.data", "import moetrain.data.registry\n", "moetrain.data.registry"),
    # siblings of one rank
    ("moetrain.data.prepare", "from moetrain.models.transformer import Transformer\n", "moetrain.models.transformer"),
    ("moetrain.interop.export", "from moetrain.plan.planner import make_plan\n", "moetrain.plan.planner"),
    # the runtime must not reach into the trainer
    ("moetrain.distributed.runtime", "from moetrain.train import trainer\n", "moetrain.train.trainer"),
    # a relative import resolved against the importing module: moetrain.cli from plan
    ("moetrain.plan.planner", "from .. import cli\n", "moetrain.cli"),
    # the command line is the top: no layer below parses arguments through it
    ("moetrain.interop.export", "from moetrain.cli.plan import parse_bytes\n", "moetrain.cli.plan"),
    ("moetrain.utils.files", "from ..config.job import JobConfig\n", "moetrain.config.job"),
])
def test_the_checker_catches_a_forbidden_import(module, source, found):
    imports = imported_modules(source, module, is_package=False, known=KNOWN)
    assert [t for _, t in imports] == [found]
    bad = violations(module, imports)
    assert len(bad) == 1 and found in bad[0], bad


@pytest.mark.parametrize("module, source", [
    ("moetrain.data.prepare", "from moetrain.config.data import DataConfig\n"),
    ("moetrain.plan.dry_run", "def f():\n    from moetrain.plan.planner import make_plan\n"),
    ("moetrain.cli", "from moetrain.interop.export import export_model\nimport moetrain.plan\n"),
    ("moetrain.cli.plan", "from . import launch\nfrom moetrain.plan.planner import make_plan\n"),
    ("moetrain.config.loader", "from . import job\nfrom .convert import config_from_dict\n"),
    ("moetrain.train.trainer", "import torch\nfrom moetrain.distributed.runtime import init\n"),
])
def test_the_checker_allows_downward_and_same_layer_imports(module, source):
    imports = imported_modules(source, module, is_package=False, known=KNOWN)
    assert imports and not violations(module, imports)


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"loader": {"deepspeed"}, "deepspeed": {"loader"}}) == ["deepspeed", "loader", "deepspeed"]
