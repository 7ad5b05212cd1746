"""Every `scripts/train.py` / `scripts/eval.py` command line written in README.md and docs/*.md composes: the
documented settings exist and take the documented values (what `--cfg job` prints; nothing is trained, loaded or
evaluated; a command for a GPU machine, or for a `vllm serve` the docs start first, is composed without the
engine's check of this machine), so that a
documented command cannot rot. A command is read from a code block (its `\\` lines joined)
or an inline code span; `accelerate launch ... scripts/train.py` is read from the script on. A command holding a
placeholder (`<task>`, a lone `...`) or an out-of-tree plugin file the docs only sketch is left out, by rule."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?:^|[\s/])scripts/(train|eval)\.py(?=\s|$)")


def _lines(text: str) -> list[str]:
    """The candidate command lines of a page: each code block's lines (continuations joined) and inline spans."""
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        found += block.replace("\\\n", " ").splitlines()
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    found += re.findall(r"`([^`\n]+)`", outside.replace("\n", " "))
    return found


def _command(line: str) -> tuple[str, list[str]] | None:
    """(train or eval, the arguments after the script) of a line that runs one, else None; a `#` comment and
    shell around the command (`pip install ... &&`, `OMP_NUM_THREADS=1`) are dropped."""
    for part in re.split(r"&&|;|\|", line.split(" #")[0]):
        match = SCRIPT.search(part)
        if match:
            try:
                words = shlex.split(part[match.end():])
            except ValueError:  # an unbalanced quote: not a command line
                return None
            return match.group(1), words
    return None


def _runnable(words: list[str]) -> bool:
    if any("<" in w or w in ("...", "…") for w in words):
        return False  # a placeholder
    sketched = [w for w in words if re.search(r"=([\w./-]+\.py):\w+$", w)]
    return all((ROOT / re.search(r"=([\w./-]+\.py):", w).group(1)).is_file() for w in sketched)


def documented_commands() -> list[tuple[str, str, list[str]]]:
    commands = []
    for page in PAGES:
        for line in _lines(page.read_text()):
            command = _command(line)
            if command is not None and _runnable(command[1]):
                commands.append((page.relative_to(ROOT).as_posix(), *command))
    return commands


COMMANDS = documented_commands()


def test_the_docs_hold_the_commands_this_test_reads():
    pages = {page for page, _, _ in COMMANDS}
    assert len(COMMANDS) >= 40 and {"README.md", "docs/async.md", "docs/getting-started.md"} <= pages, COMMANDS
    assert ("docs/async.md", "train", ["trainer.max_staleness=2", "trainer.correction=token_tis",
                                       "trainer.correction_options={cap: 2.0}"]) in COMMANDS


@pytest.mark.parametrize(("page", "script", "words"), COMMANDS,
                         ids=[f"{p}:{' '.join(w)[:60]}" for p, _, w in COMMANDS])
def test_each_documented_command_composes(page, script, words, tmp_path, monkeypatch, capsys):
    from gpg_vl.config.compose import run_cli

    # the folders a command names as a model (`model=runs/a/final`) exist where it runs, as after training
    monkeypatch.chdir(tmp_path)
    for word in words:
        if word.startswith("model=") and "/" in word:
            (tmp_path / word.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)
    composed = []
    if "rollout.engine=vllm_server" in words:  # it names a server the docs start first: no wait for one here
        monkeypatch.setattr("gpg_vl.config.compose._check_engine", lambda rollout: None)
    code = run_cli(script, composed.append, words)
    err = capsys.readouterr().err.strip()
    if code != 0 and "CUDA" in err:  # a command for GPU machines: everything but the engine's check of this one
        monkeypatch.setattr("gpg_vl.config.compose._check_engine", lambda rollout: None)
        code = run_cli(script, composed.append, words)
        err = capsys.readouterr().err.strip()
    assert code == 0 and (composed or "--cfg" in words), (
        f"{page}: `python scripts/{script}.py {' '.join(words)}` does not compose (exit {code}): {err[-400:]}")


@pytest.mark.parametrize(("overrides", "key", "expected"), [
    (["trainer.max_staleness=2", "trainer.correction=token_tis", "trainer.correction_options={cap: 3.0}"],
     "trainer.correction_options", {"cap": 3.0}),
    (["trainer.max_staleness=2", "trainer.correction=token_tis", "trainer.correction_options.cap=3.0"],
     "trainer.correction_options", {"cap": 3.0}),
    (["algorithm=grpo", "trainer.loss_options={clip_low: 0.1}"], "trainer.loss_options", {"clip_low": 0.1}),
    (["algorithm=grpo", "trainer.loss_options.clip_low=0.1"], "trainer.loss_options", {"clip_low": 0.1}),
    (["task=shapes", "task.options={train_size: 8}"], "task.options.train_size", 8),
    (["task=shapes", "task.options.train_size=8"], "task.options.train_size", 8),
    (["task=mix", "task.mixture={shapes: 1}", "task.teacher.shapes.coef=0.5"], "task.teacher.shapes.coef", 0.5)])
def test_every_option_map_takes_a_whole_map_or_one_key_without_plus_signs(overrides, key, expected):
    from omegaconf import OmegaConf

    from gpg_vl.config.compose import OPTION_MAPS, load_config

    assert set(OPTION_MAPS) == {"trainer.loss_options", "trainer.correction_options", "task.options", "task.mixture",
                                "task.rollout", "task.data", "task.teacher"}
    value = OmegaConf.select(load_config("train", overrides), key)
    assert (OmegaConf.to_container(value) if hasattr(value, "items") else value) == expected
