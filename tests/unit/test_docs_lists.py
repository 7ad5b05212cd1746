"""The docs' lists, checked against the tree so that they cannot drift: the Overview's pages against the site's
navigation, docs/layout.md's tasks and scripts against tasks/ and scripts/, docs/tasks.md's tables against the
registered tasks, docs/algorithms.md against the registered losses, README's zoom result against its page."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in entry.values():
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def built_in_tasks() -> list[str]:
    return sorted(path.stem for path in (ROOT / "tasks").glob("*.py") if path.stem != "__init__")


def test_the_overview_links_every_page_of_the_site_and_the_site_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1].join(["nav:\n", ""]))
    pages = nav_pages(config["nav"])
    on_disk = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "every docs page is in mkdocs.yml's nav, and every nav entry exists"
    linked = set(re.findall(r"\]\(([^)#]+\.md)", (DOCS / "index.md").read_text()))
    missing = sorted(set(pages) - linked - {"index.md"})
    assert not missing, f"docs/index.md's table does not link {missing}"


def test_layout_lists_every_task_and_every_script():
    layout = (DOCS / "layout.md").read_text()
    tasks_line = re.search(r"- `tasks/`:(.*?)\n- ", layout, re.DOTALL).group(1)
    listed = set(re.findall(r"[a-z_0-9]+", tasks_line))
    assert not set(built_in_tasks()) - listed, f"docs/layout.md's tasks lack {sorted(set(built_in_tasks()) - listed)}"
    scripts = sorted(path.name for path in (ROOT / "scripts").glob("*.py"))
    assert not [name for name in scripts if f"`{name}`" not in layout], "docs/layout.md lists every script"


def test_tasks_page_has_a_row_and_a_differences_table_for_every_task():
    page = (DOCS / "tasks.md").read_text()
    differences = page.split("## Differences from the reference implementations", 1)[1]
    for name in built_in_tasks():
        assert f"| `{name}` |" in page, f"docs/tasks.md's summary table has no row for {name}"
        section = re.search(rf"### `{name}`\n\n(\| case \| the reference \| gpg-vl \| why \|\n\|---\|---\|---\|---\|\n"
                            r"(\|.*\|\n)+)", differences)
        assert section, f"docs/tasks.md has no differences table for {name}"


def test_algorithms_page_lists_every_registered_loss_and_preset():
    from gpg_vl.config import names

    page = (DOCS / "algorithms.md").read_text()
    for loss in names.REGISTRIES["losses"][2]:
        assert f"`{loss}`" in page, f"docs/algorithms.md does not list the loss {loss}"
    for preset in (ROOT / "configs" / "algorithm").glob("*.yaml"):
        assert f"`{preset.stem}`" in page, f"docs/algorithms.md does not list algorithm={preset.stem}"


def test_readme_states_the_zoom_result_of_its_page():
    readme, page = (ROOT / "README.md").read_text(), (DOCS / "results" / "zoom.md").read_text()
    for claim in ("0.25", "0.70–0.72"):
        assert claim in page and readme.count(claim) >= 2  # the feature line and the Results line
    assert "negative" not in readme


def test_layout_names_every_module_of_the_package_and_no_other():
    """docs/layout.md has one line per module of gpg_vl/ (`- `gpg_vl/...py`: ...`; a package's __init__.py when
    it holds code): a module added without its line, or a line left for a module that is gone, fails here."""
    package = ROOT / "gpg_vl"
    modules = {path.relative_to(ROOT).as_posix() for path in package.rglob("*.py")
               if path.name != "__init__.py" or path.read_text().strip()}
    lines = re.findall(r"^- `(gpg_vl/[^`]+\.py)`:", (DOCS / "layout.md").read_text(), re.MULTILINE)
    assert len(lines) == len(set(lines)), "docs/layout.md names a module twice"
    assert not modules - set(lines), f"docs/layout.md has no line for {sorted(modules - set(lines))}"
    assert not set(lines) - modules, f"docs/layout.md names modules that do not exist: {sorted(set(lines) - modules)}"
