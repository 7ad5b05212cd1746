"""task=mix end to end on the tiny model: a video task (motion) and a tool task (zoom, two turns) in one run with the
difficulty sampler; killed with SIGKILL and resumed, it ends where the uninterrupted run does; each task's figures
are in metrics.jsonl, summary.json and the rollout viewer."""

import importlib.util
import json
from pathlib import Path

from helpers import procs

from gpg_vl.observe.viewer import write_rollouts_html

ROOT = Path(__file__).resolve().parents[2]
MIXTURE = ["task=mix", "task.mixture={motion: 1, zoom: 1}", "task.options.motion.train_size=6",
           "task.options.zoom.train_size=6", "task.options.zoom.image_size=224", "data.sampler=difficulty",
           "trainer.eval_after=true", "eval.limit=4", "eval.batch_size=4", "trainer.log_rollouts_every=1",
           "trainer.log_rollouts_groups=4"]


def load_script():
    spec = importlib.util.spec_from_file_location("check_resume", ROOT / "scripts" / "check_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_killed_mixture_run_resumes_to_the_same_weights_and_metrics_with_each_tasks_figures(tmp_path,
                                                                                               monkeypatch):
    script = load_script()

    def forked_train(args: list[str], log: Path, prefix: list[str] | None = None, threads: int = 1):
        return procs.Forked([*(prefix or []), str(ROOT / "scripts" / "train.py"), *args], output=log)

    monkeypatch.setattr(script, "_train", forked_train)
    result = script.check(tmp_path, steps=4, kill_after=2, overrides=MIXTURE)
    log = (tmp_path / "train.log").read_text()
    assert "checkpoint-2 at step 2" in result["resumed_from"], log[-3000:]
    assert result["weights_identical"] and result["weights_trained"], result["sha256"]
    assert result["metrics_identical_after_kill"] and result["steps_once"] and not result["partials_left"]

    full = tmp_path / "uninterrupted"
    lines = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    for task in ("motion", "zoom"):
        for key in ("reward/accuracy", "accuracy", "valid_fraction", "completion_tokens_mean", "prompts_drawn"):
            assert f"{task}/{key}" in lines[-1], sorted(lines[-1])
    assert "zoom/tool_calls_mean" in lines[-1] and "motion/tool_calls_mean" not in lines[-1]  # tools: zoom's only
    drawn = lines[-1]["motion/prompts_drawn"] + lines[-1]["zoom/prompts_drawn"]
    assert drawn == lines[-1]["data_position"] >= 4 * 4
    # six rows per task: by step 4 prompts repeat, and the sampler has read their groups
    assert any(line.get("motion/sampler/settled", 0) + line.get("zoom/sampler/settled", 0) for line in lines)
    summary = json.loads((full / "summary.json").read_text())
    after = summary["eval_after"]
    assert {"motion/accuracy", "zoom/accuracy"} <= set(after)
    assert after["accuracy"] == (after["motion/accuracy"] + after["zoom/accuracy"]) / 2 == summary["accuracy_after"]

    step = json.loads((full / "rollouts" / "step-4.json").read_text())
    assert {group["task"] for group in step["groups"]} <= {"motion", "zoom"} and step["groups"]
    page = write_rollouts_html(full).read_text()
    assert "task motion" in page or "task zoom" in page
