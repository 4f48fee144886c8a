"""Layers point one way: every import of a library module (at module level or inside a function) goes to
its own layer or to one the table below allows.

| layer        | modules                          | may import                                          |
|--------------|----------------------------------|-----------------------------------------------------|
| cli          | ``fsdp_compile/__main__.py``     | everything                                          |
| package      | ``fsdp_compile/__init__.py``     | api, compiler (the public names)                    |
| examples     | ``fsdp_compile/examples/``       | package, api, compiler, inspection, safety, emulate, compat |
| compiler     | ``fsdp_compile/compiler/``       | api, inspection, safety, passes, compat             |
| api          | ``fsdp_compile/api/``            | safety, passes, compat                              |
| inspection   | ``fsdp_compile/inspection/``     | passes, compat                                      |
| safety       | ``fsdp_compile/safety/``         | passes, compat                                      |
| emulate      | ``fsdp_compile/emulate/``        | inspection, compat                                  |
| passes       | ``passes/`` (``fsdp_compile.passes``) | nothing of ours                                |
| compat       | ``fsdp_compile/_compat.py``      | nothing of ours                                     |

So: the compiler reads what the api marks (parameters, markers) and runs the passes; inspection and safety
serve both and never import either back; ``examples`` (the demo, ``explain``, the small Llama, the rank
launcher) is imported by the command line alone. docs/design.md shows the same table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Module-name prefix -> layer; the longest prefix that matches wins.
LAYERS = {
    "fsdp_compile": "package",
    "fsdp_compile.__main__": "cli",
    "fsdp_compile.examples": "examples",
    "fsdp_compile.compiler": "compiler",
    "fsdp_compile.api": "api",
    "fsdp_compile.inspection": "inspection",
    "fsdp_compile.safety": "safety",
    "fsdp_compile.emulate": "emulate",
    "fsdp_compile.passes": "passes",
    "fsdp_compile._compat": "compat",
}
EVERY_LAYER = set(LAYERS.values())
ALLOWED = {
    "cli": EVERY_LAYER,
    "package": {"api", "compiler"},
    "examples": {"package", "api", "compiler", "inspection", "safety", "emulate", "compat"},
    "compiler": {"api", "inspection", "safety", "passes", "compat"},
    "api": {"safety", "passes", "compat"},
    "inspection": {"passes", "compat"},
    "safety": {"passes", "compat"},
    "emulate": {"inspection", "compat"},
    "passes": set(),
    "compat": set(),
}


def library_modules() -> dict[str, Path]:
    """Every library module by its dotted name; ``passes/`` is installed as ``fsdp_compile.passes``."""
    modules = {}
    for folder, package in (("fsdp_compile", "fsdp_compile"), ("passes", "fsdp_compile.passes")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name, or ``None`` for a module not of this library."""
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for each import in ``path`` (functions included), relative ones resolved;
    ``from a import b`` names ``a.b`` where that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if name in known else base))
    return list(dict.fromkeys(found))


def violations() -> list[str]:
    modules = library_modules()
    out = []
    for module, path in modules.items():
        source = layer_of(module)
        assert source is not None, module
        for line, target in imports_of(module, path, set(modules)):
            layer = layer_of(target)
            if layer is None or layer == source or layer in ALLOWED[source]:
                continue
            out.append(f"{path.relative_to(ROOT)}:{line} imports {target}: the {source} layer may not import the "
                       f"{layer} layer (it may import: {', '.join(sorted(ALLOWED[source])) or 'nothing of ours'})")
    return out


def test_imports_point_one_way() -> None:
    found = violations()
    assert not found, "imports against the layers (table in tests/test_layers.py):\n" + "\n".join(found)


def test_pyproject_installs_every_package_and_one_top_level_name() -> None:
    """pyproject.toml lists every package folder (``passes/`` as ``fsdp_compile.passes``), and nothing else."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module for module, path in library_modules().items() if path.name == "__init__.py"}
    assert set(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {"fsdp_compile.passes": "passes"} and "py-modules" not in setuptools


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("from ..compiler import backend\n\ndef f():\n    import fsdp_compile.examples.demo\n")
    known = {"fsdp_compile.compiler.backend"}
    assert imports_of("fsdp_compile.inspection.m", path, known) == [
        (1, "fsdp_compile.compiler.backend"), (4, "fsdp_compile.examples.demo")]
    assert layer_of("fsdp_compile.passes.schedule.prefetch") == "passes"
    assert layer_of("fsdp_compile") == "package" and layer_of("torch.fx") is None
