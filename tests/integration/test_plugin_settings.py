"""An out-of-tree engine and an out-of-tree tool, each with a setting of its own declared in its one file
(tests/helpers/call_engine.py: `rollout.scripted_call.every`; tests/helpers/stamp_tool.py:
`rollout.tools.stamp.text`), trained and evaluated through the command line with those settings; the config
types, checks and prints them from those declarations, before any model loads."""

import json
from pathlib import Path

import pytest

from gpg_vl.cli import eval_main, train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = f"rollout.engine={ROOT / 'tests/helpers/call_engine.py'}:ScriptedCallEngine"
TASK = f"task.name={ROOT / 'tests/helpers/stamp_tool.py'}:ShapesWithStamp"
RUN = [ENGINE, TASK, "rollout.max_turns=2", "rollout.max_new_tokens=64",  # the forced call is 54 tokens
       "trainer.batch_size=2", "trainer.group_size=2", "trainer.max_steps=1", "trainer.eval_before=false",
       "trainer.eval_after=false", "trainer.save_every=0", "trainer.log_rollouts_every=1", "trainer.beta_th=0"]
SETTINGS = ["rollout.scripted_call.every=1", "rollout.tools.stamp.text=hello-from-the-stamp"]


def test_an_out_of_tree_engine_and_tool_train_and_evaluate_through_the_cli_with_their_settings(tmp_path, capsys):
    assert run_cli("train", train_main, [f"output_dir={tmp_path / 'train'}", *RUN, *SETTINGS]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["tool_calls_mean"] >= 1.0  # every=1: every trajectory's first segment calls (default: half)
    assert "hello-from-the-stamp" in (tmp_path / "train" / "rollouts" / "step-1.json").read_text()
    config = json.loads((tmp_path / "train" / "config.json").read_text())["rollout"]
    assert config["scripted_call"] == {"every": 1} and config["tools"]["stamp"] == {"text": "hello-from-the-stamp"}
    assert run_cli("eval", eval_main, [f"output_dir={tmp_path / 'eval'}", ENGINE, TASK, "rollout.max_turns=2",
                                        "rollout.max_new_tokens=64", "eval.limit=2", *SETTINGS]) == 0
    assert "hello-from-the-stamp" in (tmp_path / "eval" / "predictions.jsonl").read_text()


def test_their_settings_are_typed_checked_and_printed_with_the_config():
    cfg = load_config("train", [ENGINE, TASK, "rollout.tools.stamp.text=hi"])
    assert cfg.rollout.scripted_call.every == 2 and cfg.rollout.tools.stamp.text == "hi"  # the engine's default
    with pytest.raises(UserError, match=r"rollout.scripted_call.every=0, allowed: an integer >= 1"):
        load_config("train", [ENGINE, "rollout.scripted_call.every=0"])
    with pytest.raises(UserError, match=r"rollout.scripted_call.every=many has the wrong type"):
        load_config("train", [ENGINE, "rollout.scripted_call.every=many"])
    with pytest.raises(UserError, match=r"rollout.tools.stamp.text=' '"):
        load_config("train", [ENGINE, TASK, "rollout.tools.stamp.text=' '"])
    with pytest.raises(UserError, match=r"unknown config key 'rollout.scripted_call.evry'"):
        load_config("train", [ENGINE, "rollout.scripted_call.evry=1"])
    with pytest.raises(UserError, match=r"unknown config key 'rollout.scripted_call.every'"):  # not this engine's
        load_config("train", ["rollout.scripted_call.every=1"])
    assert load_config("train", []).rollout.tools.zoom_in.min_side == 30  # the built-ins' sections stay
