"""Multi-turn runs through the command line: an out-of-tree task offering `zoom_in` (tests/helpers/tool_engine.py)
trains 3 steps with rollout.max_turns=3 on tiny Qwen2.5-VL, Qwen3-VL and Qwen3.5 models, its rollout log holding the
tool calls; and a multi-turn run resumes bit-exactly.

The tiny models are random, so the sampler is scripted (tests/helpers/tool_engine.py's `ScriptedToolEngine`): the
first segment of every other trajectory is a `zoom_in` call on the middle of the image, forced but scored by the model;
the other segments are sampled. The task rewards a trajectory that received a crop, so the groups carry signal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import tiny_family_path, train_run, untimed
from safetensors.torch import load_file

from gpg_vl.cli import eval_main
from gpg_vl.config.compose import load_config
from gpg_vl.models.load import load_policy

ROOT = Path(__file__).resolve().parents[2]
TOOL_RUN = [f"task.name={ROOT / 'tests/helpers/tool_engine.py'}:ShapesWithZoom",
            f"rollout.engine={ROOT / 'tests/helpers/tool_engine.py'}:ScriptedToolEngine", "rollout.max_turns=3",
            "rollout.max_new_tokens=100", "trainer.batch_size=2", "trainer.group_size=2",
            "trainer.log_rollouts_every=1"]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """family -> the folder of its 3-step tool run, run the first time a test asks: the Qwen2.5-VL run
    (checkpointing every step) is also the uninterrupted run the resume test compares with."""
    runs = {}

    def run_of(family: str) -> Path:
        if family not in runs:
            model = []
            if family != "qwen2_5_vl":
                model = [f"model.name_or_path={tiny_family_path(family, tmp_path_factory)}", "model.family=auto",
                         "trainer.save_every=0"]
            runs[family] = tmp_path_factory.mktemp(f"tool-run-{family}")
            train_run(runs[family], *TOOL_RUN, *model, "trainer.max_steps=3")
        return runs[family]

    return run_of


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_tool_using_task_trains_three_steps_and_logs_its_tool_calls(three_steps, family):
    run = three_steps(family)
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:  # every other trajectory calls the tool: half of them get a crop and a second segment
        assert m["tool_calls_mean"] >= 0.5 and m["turns_mean"] >= 1.5 and m["images_per_trajectory_mean"] >= 0.5
        assert m["observation_tokens"] > 0 and m["generated_tokens"] > 0
    assert sum(m["groups_used"] for m in steps) > 0 and any(m["loss"] != 0 for m in steps)
    logged = json.dumps(json.loads((run / "rollouts" / "step-1.json").read_text()))
    assert "zoom_in" in logged and "tool_response" in logged
    load_policy(str(run / "final"), family="auto", dtype="float32")  # the trained model reloads


def test_a_multi_turn_run_resumes_to_the_same_weights_and_metrics(tmp_path, three_steps):
    full_run = three_steps("qwen2_5_vl")  # 3 steps straight
    train_run(tmp_path / "cut", *TOOL_RUN, "trainer.max_steps=1")
    train_run(tmp_path / "cut", *TOOL_RUN, "trainer.max_steps=3", "resume=auto")
    full, cut = metrics(full_run), metrics(tmp_path / "cut")
    assert [untimed(m) for m in cut] == [untimed(m) for m in full]
    assert full[-1]["tool_calls_mean"] > 0 and full[-1]["groups_used"] > 0  # the resumed step rolled out tools
    before = load_file(full_run / "final" / "model.safetensors")
    after = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_evaluation_decodes_trajectories_greedily_through_the_engine(tmp_path):
    """scripts/eval.py with rollout.max_turns=3: greedy trajectories with the task's tools, their metrics."""
    metrics = eval_main(load_config("eval", [f"output_dir={tmp_path}", "eval.limit=4", "eval.batch_size=4",
                                             *[o for o in TOOL_RUN if o.startswith(("task.", "rollout."))]]))
    # groups of one: the script calls the tool in rows 0 and 2 of the batch of 4, each getting its crop
    assert metrics["tool_calls_mean"] == 0.5 and metrics["images_per_trajectory_mean"] == 0.5
    assert metrics["turns_mean"] >= 1.5 and "accuracy" in metrics
    assert len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 4
