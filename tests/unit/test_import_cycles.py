"""The package's import graph has no cycle: every import of a gpg_vl module counts (module level, inside a
function, under `if TYPE_CHECKING:`), and modules inside the package never import the top package itself."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpg_vl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` means: itself when it is a module of the package, else its nearest package."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gpg_vl modules that `module` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y, from . import y
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from gpg_vl.pkg import name` imports the submodule gpg_vl.pkg.name where that file exists
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "gpg_vl" or target.startswith("gpg_vl."):
                resolved = resolve(target, known)
                if resolved is not None and resolved != module:
                    found.add(resolved)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(module, path, known) for module, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_import_resolution_counts_every_kind_of_import(tmp_path):
    known = {"gpg_vl": Path("gpg_vl/__init__.py"), "gpg_vl.pkg": Path("gpg_vl/pkg/__init__.py"),
             "gpg_vl.pkg.sub": Path("gpg_vl/pkg/sub.py"), "gpg_vl.pkg.me": Path("gpg_vl/pkg/me.py")}
    source = tmp_path / "me.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from gpg_vl.pkg import sub\n"
                      "def f():\n    from gpg_vl.pkg import thing\n    import gpg_vl.errors\n"
                      "from . import other\n")
    assert imports("gpg_vl.pkg.me", source, known) == {"gpg_vl.pkg.sub", "gpg_vl.pkg", "gpg_vl"}


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_the_top_package():
    importers = sorted(module for module, targets in graph().items() if "gpg_vl" in targets and module != "gpg_vl")
    assert not importers, f"these modules import the top package gpg_vl (import the submodule instead): {importers}"
