"""trainer.max_sampled_tokens: the tokens the policy sampled are counted (state.counters["tokens_sampled"], the
cumulative metric `tokens_sampled`), the same as the step metrics' own token counts (single turn: completion
lengths; multi-turn: generated tokens, observations excluded); a run stops at the first step whose count reaches
the budget, and a resumed run at the same step."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.runs import train_run, untimed

ROOT = Path(__file__).resolve().parents[2]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_stopped_on_budget(steps: list[dict], step_tokens: list[int], budget: int) -> None:
    """The cumulative metric is the running sum of the steps' own counts, and the last step is the first to
    reach the budget."""
    running = [sum(step_tokens[:i + 1]) for i in range(len(step_tokens))]
    assert [m["tokens_sampled"] for m in steps] == running
    assert running[-1] >= budget and all(count < budget for count in running[:-1])


def test_multi_turn_count_is_the_generated_tokens(tmp_path):
    """The scripted tool run of tests/integration/test_tool_runs.py: observation tokens never count."""
    budget = 100  # 4 trajectories of up to 2 segments of 16 tokens per step: 2 steps or more
    tool_run = [f"task.name={ROOT / 'tests/helpers/tool_engine.py'}:ShapesWithZoom",
                f"rollout.engine={ROOT / 'tests/helpers/tool_engine.py'}:ScriptedToolEngine", "rollout.max_turns=2",
                "rollout.max_new_tokens=16", "trainer.batch_size=2", "trainer.group_size=2", "trainer.save_every=0",
                "trainer.log_rollouts_every=1", f"trainer.max_sampled_tokens={budget}", "trainer.max_steps=10"]
    summary = train_run(tmp_path, *tool_run)
    steps = metrics(tmp_path)
    assert all(m["observation_tokens"] > 0 for m in steps)  # tool calls were answered, and not counted
    assert_stopped_on_budget(steps, [round(m["generated_tokens"]) for m in steps], budget)
    logged = [sum(c["generated"] for g in json.loads((tmp_path / "rollouts" / f"step-{m['step']}.json").read_text())
                  ["groups"] for c in g["completions"]) for m in steps]  # each completion's, every group logged
    assert logged == [round(m["generated_tokens"]) for m in steps]
    assert 1 < summary["steps"] == len(steps) < 10 and summary["tokens_sampled"] == steps[-1]["tokens_sampled"]


def test_single_turn_count_resampling_included_and_a_resumed_run_stops_at_the_same_step(tmp_path, capsys):
    """beta_th=1 resamples: every completion's tokens count, resampled ones too (completion_tokens_mean is the mean
    over every completion of a step). A run cut after one step and resumed stops where the straight run did, with
    the same metrics; resuming the finished run adds no step (its last checkpoint spent the budget)."""
    group_size, budget = 2, 300  # at most 3 rollouts of 4 x 2 x 10 = 80 tokens per step: 2 steps or more
    run = ["trainer.beta_th=1.0", "trainer.max_attempts=3", f"trainer.group_size={group_size}",
           "rollout.max_new_tokens=10", "trainer.lr=1e-4", f"trainer.max_sampled_tokens={budget}"]
    full = train_run(tmp_path / "full", *run, "trainer.max_steps=10")
    steps = metrics(tmp_path / "full")
    tokens = [round(m["completion_tokens_mean"] * m["groups_sampled"] * group_size) for m in steps]
    assert_stopped_on_budget(steps, tokens, budget)
    assert full["tokens_sampled"] == steps[-1]["tokens_sampled"] and 1 < full["steps"] == len(steps) < 10
    said = (f"The run ended after step {len(steps)} of trainer.max_steps=10: its budget of sampled tokens is spent "
            f"({full['tokens_sampled']} sampled, trainer.max_sampled_tokens={budget}).")
    assert said in capsys.readouterr().out.splitlines() and full["ended_by"] in said  # one line, on its own
    assert full["completions_sampled"] == sum(m["groups_sampled"] * group_size for m in steps)
    train_run(tmp_path / "cut", *run, "trainer.max_steps=1")
    cut = train_run(tmp_path / "cut", *run, "trainer.max_steps=10", "resume=auto")
    assert [untimed(m) for m in metrics(tmp_path / "cut")] == [untimed(m) for m in steps]
    assert (cut["steps"], cut["tokens_sampled"]) == (full["steps"], full["tokens_sampled"])
    again = train_run(tmp_path / "full", *run, "trainer.max_steps=10", "resume=auto")
    assert (again["steps"], again["tokens_sampled"]) == (full["steps"], full["tokens_sampled"])
    assert len(metrics(tmp_path / "full")) == len(steps)
