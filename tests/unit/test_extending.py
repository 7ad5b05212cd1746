"""docs/extending.md's "Files you touch" table is true: every kind has its row; each built-in of a kind lives in
the files its in-tree cell names, through the names.py tables that cell names; an engine's and a tool's settings
are where the row says; and each out-of-tree example is one file defining what the row says."""

import ast
import fnmatch
import importlib
import re
from pathlib import Path

from gpg_vl.config import names

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("task", "tool", "judge", "judge mode", "family", "loss", "advantage", "engine", "correction", "sampler",
         "tool rewards", "GUI reward", "teacher loss")
# kind -> the names.py tables of its built-ins (code first, settings second)
TABLES = {"task": ("TASK_BUILTINS",), "tool": ("TOOL_BUILTINS", "TOOL_SETTINGS"), "judge": ("JUDGE_BUILTINS",),
          "judge mode": ("JUDGE_MODE_BUILTINS",),
          "family": ("FAMILY_BUILTINS",), "loss": ("LOSS_BUILTINS",), "advantage": ("ADVANTAGE_BUILTINS",),
          "engine": ("ENGINE_BUILTINS", "ENGINE_SETTINGS"), "correction": ("CORRECTION_BUILTINS",),
          "sampler": ("SAMPLER_BUILTINS",), "tool rewards": ("TOOL_REWARD_BUILTINS",),
          "GUI reward": ("GUI_REWARD_BUILTINS",),
          "teacher loss": ("TEACHER_LOSS_BUILTINS",)}


def table() -> dict[str, tuple[str, str]]:
    """kind -> (in-tree cell, out-of-tree cell) of the "Files you touch" table."""
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("## Files you touch"):]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in KINDS:
            rows[cells[0]] = (cells[2], cells[3])
    return rows


def paths(cell: str) -> list[str]:
    return [code for code in re.findall(r"`([^`]+)`", cell) if "/" in code or code.endswith(".py")]


def module_file(reference: str) -> str:
    """The file of a built-in's `module:attr`, relative to the checkout (gpg_vl_tasks is the tasks/ folder)."""
    module = reference.split(":")[0]
    return str(Path(*module.replace("gpg_vl_tasks", "tasks", 1).split("."))) + ".py"


def test_every_kind_has_its_row():
    assert set(table()) == set(KINDS)


def test_every_registry_is_a_kind_of_the_table():
    """Each registry of gpg_vl/config/names.py (REGISTRIES) has its row: the table of its built-ins is a kind's."""
    tables = {name for kind in KINDS for name in TABLES[kind]}
    for key, (_, _, builtins) in names.REGISTRIES.items():
        found = [name for name in dir(names) if name.endswith("_BUILTINS") and tuple(getattr(names, name)) == builtins]
        assert found and set(found) & tables, f"registry {key} has no row in docs/extending.md's table"


def test_every_built_in_lives_in_the_files_its_row_names():
    for kind, (inside, _) in table().items():
        listed = paths(inside)
        patterns = [path.replace("<name>", "*").replace("<alias>", "*") for path in listed]
        for name in TABLES[kind]:
            assert f"`{name}`" in inside, (kind, name)  # the row names the table
            for builtin, reference in getattr(names, name).items():
                file = module_file(reference)
                assert (ROOT / file).is_file(), (kind, builtin, file)
                assert any(fnmatch.fnmatch(file, pattern) for pattern in patterns), (kind, builtin, file, listed)
        for path in listed:  # every fixed path exists; every pattern matches something
            matches = list(ROOT.glob(path.replace("<name>", "*").replace("<alias>", "*")))
            assert matches, (kind, path)


def test_a_built_in_with_a_config_file_per_name_has_it():
    for kind, folder in (("task", "task"), ("loss", "algorithm")):
        assert f"configs/{folder}/<name>.yaml" in table()[kind][0]
        builtins = getattr(names, TABLES[kind][0])
        for name in builtins:
            if kind == "task" or (ROOT / "configs" / folder / f"{name}.yaml").is_file():
                assert (ROOT / "configs" / folder / f"{name}.yaml").is_file(), (kind, name)


def test_an_engine_and_a_tool_own_the_settings_the_tables_point_at():
    from gpg_vl.registry import load_reference
    from gpg_vl.rollout.engine import ENGINES
    from gpg_vl.rollout.multiturn.tools import TOOLS

    for table_name, registry in (("ENGINE_SETTINGS", ENGINES), ("TOOL_SETTINGS", TOOLS)):
        for name, reference in getattr(names, table_name).items():
            assert registry.get(name).settings_class is load_reference(reference, "settings"), name


def test_each_out_of_tree_example_is_one_file_defining_what_its_row_says():
    rows = table()
    for kind, (_, outside) in rows.items():
        assert outside.startswith("one file:"), kind
    examples = {kind: re.search(r"example: `([^`]+)`", rows[kind][1]) for kind in rows}
    engine, tool = examples["engine"].group(1), examples["tool"].group(1)
    source = (ROOT / engine).read_text()
    assert "settings_class = " in source and "(HFEngine)" in source  # an engine with its own settings
    source = (ROOT / tool).read_text()
    tree = ast.parse(source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") ==
             "register_tool"]
    assert calls and any(keyword.arg == "settings" for keyword in calls[0].keywords)  # a tool with its settings
    assert "tools = (" in source  # and the task that offers it
    assert (ROOT / examples["task"].group(1)).is_file()
    importlib.import_module("gpg_vl.config.keys")  # what both examples declare their settings with
