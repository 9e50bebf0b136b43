"""Dependencies point one way: every import in ``poplar/`` (function-level ones included) goes to
its own layer or a layer below it (docs/design.md §6). The test fails on any import against the
order, and the checker is tested on a package written for the purpose."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# each layer and the layers it may import (itself always); the package root is the public facade
LAYERS: dict[str, set[str]] = {
    "types": set(),
    "planner": {"types"},
    "workloads": {"types"},
    "comm": {"types"},
    "zero": {"types", "comm"},
    "profiler": {"types", "comm", "zero"},
    "auto": {"types", "comm", "zero", "profiler", "planner"},
    "engine": {"types", "comm", "zero", "profiler", "planner", "auto"},
    "checkpoint": {"types", "comm", "zero"},
    "train": {"types", "comm", "zero", "profiler", "planner", "auto", "engine", "checkpoint"},
    "cli": {"types", "comm", "zero", "profiler", "planner", "auto", "engine", "checkpoint", "train", "workloads",
            "facade"},
    "facade": {"types", "comm", "zero", "profiler", "planner", "auto", "engine", "checkpoint", "train", "workloads"},
}
POPLAR = Path(__file__).resolve().parents[1] / "poplar"


def layer_of(module: str, package: str = "poplar") -> str:
    parts = module.split(".")
    assert parts[0] == package, module
    if len(parts) == 1 or parts[1] == "__main__":
        return "facade" if len(parts) == 1 else "cli"
    return parts[1]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports anywhere in the file, resolved to absolute names."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base))
    return out


def violations(root: Path, layers: dict[str, set[str]]) -> list[str]:
    package = root.name
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        here = layer_of(module, package)
        if here not in layers:
            found.append(f"{path}: module {module} is in no layer; add its package to LAYERS")
            continue
        for line, target in imports_of(path, module):
            if target != package and not target.startswith(package + "."):
                continue
            there = layer_of(target, package)
            if there != here and there not in layers[here]:
                found.append(f"{path}:{line}: {here} imports {target} ({there}), against the layer order")
    return found


def test_poplar_imports_point_one_way() -> None:
    found = violations(POPLAR, LAYERS)
    assert not found, "\n".join(found)


def test_every_top_level_entry_is_a_layer() -> None:
    names = {p.stem if p.suffix == ".py" else p.name for p in POPLAR.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert names - {"__init__", "__main__"} <= set(LAYERS), names - set(LAYERS)


@pytest.mark.parametrize("lazy", [False, True])
def test_checker_catches_an_upward_import(tmp_path: Path, lazy: bool) -> None:
    root = tmp_path / "poplar"
    for pkg in ("types", "zero", "train"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "train" / "loop.py").write_text("from poplar.zero import runtime\n")
    (root / "zero" / "runtime.py").write_text("from ..types import plans\n")
    (root / "types" / "plans.py").write_text("import json\n")
    layers = {"types": set(), "zero": {"types"}, "train": {"types", "zero"}, "facade": set()}
    assert violations(root, layers) == []
    upward = "def f():\n    from poplar.train.loop import g\n" if lazy else "from ..train import loop\n"
    (root / "zero" / "stage.py").write_text(upward)
    found = violations(root, layers)
    assert len(found) == 1 and "zero imports poplar.train" in found[0], found
