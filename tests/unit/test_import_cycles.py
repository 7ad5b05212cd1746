"""The package's import graph has no cycle, by the strict reading: every import of a gpg_vl module counts (module
level, inside a function, under `if TYPE_CHECKING:`), and an import names every package on its dotted path, as
Python runs each package's `__init__` first: `from gpg_vl.models import scoring` imports gpg_vl.models and
gpg_vl.models.scoring, `import gpg_vl.train.loop` imports gpg_vl.train and gpg_vl.train.loop. The top package
`gpg_vl` is the one exception (its `__init__` runs before any module of the package): it imports gpg_vl.errors
alone when it loads, and no module inside the package imports the top package itself."""

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
    """The gpg_vl modules and packages that `module` imports anywhere in its file (the strict reading)."""
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
            # `from gpg_vl.pkg import name` runs gpg_vl.pkg, and imports the submodule gpg_vl.pkg.name where that
            # file exists
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
        else:
            continue
        for target in targets:
            if target == "gpg_vl" or target.startswith("gpg_vl."):
                resolved = resolve(target, known)
                if resolved is None:
                    continue
                parts = resolved.split(".")
                # the module itself, and every package on its path but the top one (see the module's docstring)
                found |= {".".join(parts[:end]) for end in range(2, len(parts) + 1)}
                if resolved == "gpg_vl":
                    found.add("gpg_vl")
    found.discard(module)
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
             "gpg_vl.pkg.sub": Path("gpg_vl/pkg/sub.py"), "gpg_vl.pkg.me": Path("gpg_vl/pkg/me.py"),
             "gpg_vl.other": Path("gpg_vl/other/__init__.py"), "gpg_vl.other.deep": Path("gpg_vl/other/deep.py")}
    source = tmp_path / "me.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from gpg_vl.pkg import sub\n"
                      "def f():\n    from gpg_vl.pkg import thing\n    import gpg_vl.errors\n"
                      "from . import other\n")
    assert imports("gpg_vl.pkg.me", source, known) == {"gpg_vl.pkg.sub", "gpg_vl.pkg", "gpg_vl"}
    source.write_text("import gpg_vl.other.deep\n")
    assert imports("gpg_vl.pkg.me", source, known) == {"gpg_vl.other", "gpg_vl.other.deep"}


def test_the_strict_reading_finds_a_package_that_re_exports_its_module():
    """The cycle this reading exists for: a package's `__init__` imports its module `load`, which imports
    `family`, which says `from pkg import scoring` (running the package's `__init__` again)."""
    known = {"gpg_vl": Path("gpg_vl/__init__.py"), "gpg_vl.models": Path("gpg_vl/models/__init__.py"),
             "gpg_vl.models.load": Path("load.py"), "gpg_vl.models.family": Path("family.py"),
             "gpg_vl.models.scoring": Path("scoring.py")}
    edges = {"gpg_vl.models": {"gpg_vl.models.load"}, "gpg_vl.models.load": {"gpg_vl.models.family"},
             "gpg_vl.models.family": {"gpg_vl.models", "gpg_vl.models.scoring"}, "gpg_vl.models.scoring": set()}
    assert find_cycle(edges) == ["gpg_vl.models", "gpg_vl.models.load", "gpg_vl.models.family", "gpg_vl.models"]
    assert "gpg_vl.models" in imports("gpg_vl.models.family", _written("from gpg_vl.models import scoring\n"), known)


def _written(text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "family.py"
    path.write_text(text)
    return path


def test_the_top_package_loads_only_the_errors_module():
    """The reading's one exception stays harmless: gpg_vl/__init__.py imports gpg_vl.errors alone at module level
    (its other names load on first use), and gpg_vl.errors imports nothing of the package."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    eager |= {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in eager if name.startswith("gpg_vl")} == {"gpg_vl.errors"}
    assert graph()["gpg_vl.errors"] == set()


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_the_top_package():
    importers = sorted(module for module, targets in graph().items() if "gpg_vl" in targets and module != "gpg_vl")
    assert not importers, f"these modules import the top package gpg_vl (import the submodule instead): {importers}"


def test_observe_reads_what_train_writes_without_importing_train():
    """observe/ (the rollout log, the viewer, reports) shares what it needs with train/ through shared modules
    (gpg_vl/files.py's write_atomic), never by importing the trainer."""
    edges = graph()
    importers = sorted(f"{module} -> {target}" for module, targets in edges.items()
                       if module.startswith("gpg_vl.observe") for target in targets
                       if target == "gpg_vl.train" or target.startswith("gpg_vl.train."))
    assert not importers, importers



def test_data_imports_nothing_above_it():
    """data/ (tasks, their rows, streams, mixtures) stands on the settings' names, the errors and the registry alone:
    the checks that need a model (`require_inputs`) live where the model is built, and what a completion's answer
    and a box are is data/answers.py's, which the rewards import."""
    edges = graph()
    allowed = ("gpg_vl.data", "gpg_vl.config", "gpg_vl.errors", "gpg_vl.registry", "gpg_vl.files")
    above = sorted(f"{module} -> {target}" for module, targets in edges.items() if module.startswith("gpg_vl.data")
                   for target in targets if not target.startswith(allowed))
    assert not above, above


def test_trains_rooms_import_each_other_without_a_circle():
    """train/'s sub-packages (step, teacher, checkpoint, eval) and the run's own modules at train/ import each other
    one way: the run imports its rooms, step imports checkpoint and teacher, eval imports step; no room imports the
    run's modules or a room that imports it back."""
    edges = graph()
    packages = {name.split(".")[2] for name, path in modules().items()
                if name.startswith("gpg_vl.train.") and path.name == "__init__.py"}
    assert {"step", "teacher", "checkpoint", "eval"} <= packages

    def room(module: str) -> str:
        part = module.split(".")[2]
        return part if part in packages else "run"

    rooms: dict[str, set[str]] = {}
    for module, targets in edges.items():
        if module.startswith("gpg_vl.train."):
            for target in targets:  # the package gpg_vl.train itself (empty) is every module's
                if target.startswith("gpg_vl.train.") and room(target) != room(module):
                    rooms.setdefault(room(module), set()).add(room(target))
    assert find_cycle(rooms) is None, rooms
    assert "run" not in set().union(*rooms.values()), rooms


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/ (or a fixture): a test module never imports another test module."""
    tests = PACKAGE.parent / "tests"
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(tests)}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_")]
    assert not found, "test modules importing test modules:\n" + "\n".join(found)
