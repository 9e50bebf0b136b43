"""Dependencies point one way: every import in ``poplar/`` (function-level ones included) goes to
its own layer or a layer below it (docs/design.md §6). The CPU emulator (``poplar/emulation/``)
sits beside the product: it may import the product, the command line may import it, and no
product package (nor the package root) ever does. The test fails on any import against the
order, and the checker is tested on a package written for the purpose.

The doors stay small: no public function or method in ``poplar/`` takes more than
``MAX_PARAMETERS`` named parameters, and no ``register_*loop*`` callback holds layers together."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

# each layer and the layers it may import (itself always); the package root is the public facade
LAYERS: dict[str, set[str]] = {
    # Poplar's logger and progress bar: every layer may report
    "logs": set(),
    "types": {"logs"},
    "planner": {"logs", "types"},
    "workloads": {"logs", "types"},
    # a process's life in a distributed job (launch, timeouts, failure lines, signals)
    "process": {"logs", "types"},
    "comm": {"logs", "types", "process"},
    "zero": {"logs", "types", "comm", "process"},
    # the planner is pure (types only): the profiler uses its shard memory and lead terms
    "profiler": {"logs", "types", "comm", "process", "zero", "planner"},
    "auto": {"logs", "types", "comm", "process", "zero", "profiler", "planner"},
    "engine": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto"},
    "checkpoint": {"logs", "types", "comm", "process", "zero"},
    # the loop, and a run built from a config: its built-in models and data (workloads) too
    "train": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto", "engine", "checkpoint",
              "workloads"},
    # above the training loop: the doors of other frameworks' loops (optional dependencies)
    "integrations": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto", "engine", "checkpoint",
                     "train", "workloads"},
    "cli": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto", "engine", "checkpoint",
            "train", "workloads", "facade", "emulation", "integrations"},
    "facade": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto", "engine", "checkpoint",
               "train", "workloads"},
    # beside the product: it may use any product layer; only the command line (and tests, benches) use it
    "emulation": {"logs", "types", "comm", "process", "zero", "profiler", "planner", "auto", "engine", "checkpoint",
                  "train", "workloads"},
}
PRODUCT = set(LAYERS) - {"cli", "emulation"}
MAX_PARAMETERS = 10
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


@functools.lru_cache(maxsize=None)
def _nodes(text: str, filename: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(text, filename)))


def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the file's syntax tree, parsed once per content for all the checks here (the
    tests of the checkers write files of their own, so the key is the text, not the path)."""
    return _nodes(path.read_text(), str(path))


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports anywhere in the file, resolved to absolute names."""
    is_package = path.name == "__init__.py"
    out = []
    for node in nodes(path):
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


def package_imports(root: Path) -> list[tuple[Path, int, str, str, str]]:
    """Every import of the package's own modules: (file, line, its layer, the module imported,
    that module's layer)."""
    package = root.name
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        here = layer_of(module, package)
        for line, target in imports_of(path, module):
            if target == package or target.startswith(package + "."):
                found.append((path, line, here, target, layer_of(target, package)))
    return found


def violations(root: Path, layers: dict[str, set[str]]) -> list[str]:
    package = root.name
    found = [f"{path}: module {module_name(path, root)} is in no layer; add its package to LAYERS"
             for path in sorted(root.rglob("*.py")) if layer_of(module_name(path, root), package) not in layers]
    for path, line, here, target, there in package_imports(root):
        if here in layers and there != here and there not in layers[here]:
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


def emulation_imports(root: Path) -> list[str]:
    """Every import of the emulator (``<package>.emulation``) from a product layer."""
    return [f"{path}:{line}: {here} imports the emulator ({target})"
            for path, line, here, target, there in package_imports(root)
            if there == "emulation" and here not in ("cli", "emulation")]


def test_no_product_package_imports_the_emulator() -> None:
    assert not any("emulation" in LAYERS[layer] for layer in PRODUCT)
    found = emulation_imports(POPLAR)
    assert not found, "\n".join(found)


def test_the_profiler_holds_no_emulator_module() -> None:
    emulator = ("virtual_", "speed_padding", "block_pacing", "saved_tensors", "speed_curves", "link_calibration",
                "calibration", "emulate", "faults")
    left = [p.name for p in (POPLAR / "profiler").glob("*.py") if p.stem.startswith(emulator)]
    assert not left, left


@pytest.mark.parametrize("lazy", [False, True])
def test_checker_catches_a_product_import_of_the_emulator(tmp_path: Path, lazy: bool) -> None:
    root = tmp_path / "poplar"
    for pkg in ("types", "profiler", "emulation", "cli"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "emulation" / "virtual_device.py").write_text("from poplar.profiler import devices\n")
    (root / "cli" / "demo.py").write_text("from poplar.emulation import virtual_device\n")
    (root / "profiler" / "devices.py").write_text("from poplar.types import plans\n")
    assert emulation_imports(root) == []
    bad = "def f():\n    from poplar.emulation.virtual_device import X\n" if lazy else \
        "from ..emulation import virtual_device\n"
    (root / "profiler" / "capacity.py").write_text(bad)
    found = emulation_imports(root)
    assert len(found) == 1 and "profiler imports the emulator" in found[0], found
    layers = {"types": set(), "profiler": {"types"}, "emulation": {"types", "profiler"}, "cli": {"emulation"},
              "facade": set()}
    assert any("profiler imports poplar.emulation" in v for v in violations(root, layers))


def wide_public_functions(root: Path, limit: int = MAX_PARAMETERS) -> list[str]:
    """Public functions and methods (no leading underscore; ``__init__`` counts) with more than
    ``limit`` named parameters (positional and keyword-only, ``self`` / ``cls`` left out)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in nodes(path):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            a = node.args
            count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            if a.args and a.args[0].arg in ("self", "cls"):
                count -= 1
            if count > limit:
                found.append(f"{path}:{node.lineno} {node.name} takes {count} parameters (at most {limit}: group "
                             "the rarely used ones into a policy dataclass)")
    return found


def loop_registrations(root: Path) -> list[str]:
    """Functions named ``register_*loop*``: callbacks that hold an upper layer to a lower one."""
    return [f"{path}:{node.lineno} {node.name}" for path in sorted(root.rglob("*.py"))
            for node in nodes(path)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("register_")
            and "loop" in node.name]


def test_public_doors_are_small() -> None:
    found = wide_public_functions(POPLAR)
    assert not found, "\n".join(found)


def test_no_loop_registration() -> None:
    found = loop_registrations(POPLAR)
    assert not found, "\n".join(found)


def test_door_checkers_catch_a_wide_function_and_a_registration(tmp_path: Path) -> None:
    root = tmp_path / "poplar"
    root.mkdir()
    (root / "ok.py").write_text("class A:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n"
                                "def _private(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n")
    assert wide_public_functions(root) == [] and loop_registrations(root) == []
    (root / "wide.py").write_text("def fit(a, b, c, d, e, f, g, h, i, *, j=1, k=2):\n    pass\n"
                                  "def register_fit_loop(loop):\n    pass\n")
    wide = wide_public_functions(root)
    assert len(wide) == 1 and "fit takes 11 parameters" in wide[0], wide
    assert len(loop_registrations(root)) == 1
