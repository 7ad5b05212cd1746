"""Ablation variants in the trainer, scripts/ablate.py and scripts/grad_variance.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch
from helpers import procs
from helpers.learners import learner_for

from gpg_vl.config.compose import load_config
from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import build_engine
from gpg_vl.train.loop import RunSettings, setup_policy, train
from gpg_vl.train.step.sample import sample_attempt
from gpg_vl.train.step.update import update

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the variants in the trainer
def test_variant_keys_are_on_the_command_line_and_bad_values_fail_in_one_sentence():
    cfg = load_config("train", ["trainer.age=false", "trainer.advantage=none", "trainer.beta_th=0",
                                "trainer.max_completions=64", "trainer.group_size=16"])
    assert (cfg.trainer.age, cfg.trainer.advantage, cfg.trainer.max_completions) == (False, "none", 64)
    assert load_config("train", []).trainer.age is True  # AGE and the group baseline are the default
    assert load_config("train", []).trainer.advantage == "group_mean"
    with pytest.raises(UserError, match="unknown trainer.advantage 'zero'; valid options: group_mean, none, "
                                        "std_normalized"):
        TrainerSettings(advantage="zero")
    # the deprecated keys still work, with one warning, and are resolved into trainer.advantage
    assert load_config("train", ["trainer.baseline=none"]).trainer.advantage == "none"
    assert TrainerSettings(std_normalize=True).advantage == "std_normalized"
    with pytest.raises(UserError, match="set trainer.advantage=std_normalized"):
        TrainerSettings(baseline="none", std_normalize=True)


def test_without_baseline_the_advantage_is_the_reward_and_valid_means_a_nonzero_reward(policy, shapes):
    from gpg_vl.data.stream import PromptStream

    stream = PromptStream(shapes.load("train"), seed=0)
    rollout = RolloutSettings(max_new_tokens=12)
    attempt = sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                             trainer=TrainerSettings(batch_size=3, group_size=2, advantage="none", reward_workers=1),
                             warn=print)
    assert attempt.valid.tolist() == (attempt.rewards != 0).any(dim=1).tolist()
    expected = torch.where(attempt.valid.unsqueeze(1), attempt.rewards, torch.zeros_like(attempt.rewards))
    assert torch.equal(attempt.advantages, expected)


def _fake_attempt(attempt, valid: list[bool], seed: int):
    """The same completions with chosen valid groups and random advantages on them (zero elsewhere)."""
    valid = torch.tensor(valid)
    advantages = torch.randn(attempt.rewards.shape, generator=torch.Generator().manual_seed(seed))  # [b, G]
    advantages = torch.where(valid.unsqueeze(1), advantages, torch.zeros_like(advantages))
    return dataclasses.replace(attempt, advantages=advantages, valid=valid)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the flattened gradient of its last step."""

    def step(self, closure=None):
        self.grad = torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]
                               if p.grad is not None])
        return super().step(closure)


def test_without_age_only_the_normalizer_changes_to_every_sampled_sequence_across_resampled_attempts(policy, shapes):
    """Two attempts (a resampled step) of 3 groups x G 2, 3 of the 6 groups valid: the gradient the optimizer
    steps on without AGE is exactly (valid sequences / sampled sequences) = 1/2 of the AGE gradient."""
    from accelerate import Accelerator

    from gpg_vl.data.stream import PromptStream

    stream = PromptStream(shapes.load("train"), seed=0)
    rollout = RolloutSettings(max_new_tokens=10)
    drawn = [sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                            trainer=TrainerSettings(batch_size=3, group_size=2, reward_workers=1), warn=print)
             for _ in range(2)]
    attempts = [_fake_attempt(drawn[0], [True, False, True], 1), _fake_attempt(drawn[1], [False, True, False], 2)]
    accelerator = Accelerator(cpu=True)
    grads, losses = {}, {}
    for age in (True, False):
        model = copy.deepcopy(policy.model)
        optimizer = RecordingSGD(model.parameters(), lr=1.0)
        settings = TrainerSettings(age=age, micro_batch_size=4, max_grad_norm=1e9)
        result = update(learner_for(policy, settings, model=model, optimizer=optimizer, accelerator=accelerator),
                        attempts)
        losses[age], grads[age] = result["loss"], optimizer.grad
    assert grads[True].abs().max() > 0
    assert losses[False] == pytest.approx(0.5 * losses[True], rel=1e-5)
    assert torch.allclose(grads[False], 0.5 * grads[True], rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("age", [True, False])
def test_logged_alpha_with_resampling_and_an_exact_completion_budget(tmp_path, policy, shapes, age):
    """beta_th=1 forces resampling; alpha is B_sampled / B_valid with AGE and 1 without; the run stops on the
    budget of sampled completions, resampled ones included, and never samples past it."""
    budget = 32  # 4 rollouts of B 4 x G 2
    summary = train(setup_policy(policy, shapes, RunSettings(trainer=TrainerSettings(
        max_steps=20, group_size=2, batch_size=4, lr=1e-4, beta_th=1.0, max_attempts=3, age=age,
        max_completions=budget, eval_before=False, eval_after=False),
        rollout=RolloutSettings(max_new_tokens=10), output_dir=tmp_path)))
    lines = metrics(tmp_path)
    assert summary["completions_sampled"] == budget == sum(m["groups_sampled"] * 2 for m in lines)
    assert [m["completions_sampled"] for m in lines][-1] == budget and summary["steps"] == len(lines)
    assert len(lines) < 4  # resampling spent the budget in fewer steps than 4 single rollouts
    for m in lines:
        if m["groups_used"]:
            assert m["alpha"] == (pytest.approx(m["groups_sampled"] / m["groups_used"]) if age else 1.0)


# ----------------------------------------------------------------------------- scripts/ablate.py
def test_running_proxy_and_completions_to_target_by_hand():
    ablate = load_script("ablate")
    # steps of 4, 4 and 8 completions with accuracies 0.25, 0.75 and 1.0; window 8
    curve = [{"completions": 4, "accuracy": 0.25}, {"completions": 8, "accuracy": 0.75},
             {"completions": 16, "accuracy": 1.0}]
    points = ablate.running_proxy(curve, window=8)
    # step 1: 0.25 over 4 (not a full window); step 2: (1 + 3) / 8 = 0.5 (full);
    # step 3: only step 3 ended less than 8 completions ago -> 1.0 over its 8 completions (full)
    assert points == [(4, 0.25, False), (8, 0.5, True), (16, 1.0, True)]
    assert ablate.completions_to_target(curve, window=8, target=0.5) == 8
    assert ablate.completions_to_target(curve, window=8, target=0.9) == 16
    assert ablate.completions_to_target(curve, window=8, target=0.2) == 8  # step 1's window is not full
    assert ablate.completions_to_target(curve[:1], window=8, target=0.1) is None


def test_budget_must_be_a_multiple_of_one_step_of_the_largest_group(capsys):
    ablate = load_script("ablate")
    with pytest.raises(SystemExit):
        ablate.parse_args(["--budget", "100", "--batch-size", "8", "--groups", "2", "16"])
    assert "multiple of B x max G = 128" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_grid_writes_every_number_a_plot_and_spends_equal_budgets(tmp_path):
    # three of the five variants (the two with checks of their own below), one G, one worker: the suite's time on
    # 2 cores (`--quick` alone runs all five at G=2 and 4)
    done = procs.run(["scripts/ablate.py", "--quick", "--workers", "1", "--variants", "gpg", "no_resampling",
                      "no_age", "--groups", "2", "--out", str(tmp_path)], timeout=600)  # forked: helpers/procs.py
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "ablation.json").read_text())
    settings = report["settings"]
    variants, groups, seeds = settings["variants"], settings["groups"], settings["seeds"]
    assert list(variants) == ["gpg", "no_resampling", "no_age"] and settings["workers"] == 1
    assert len(report["runs"]) == len(variants) * len(groups) * len(seeds)
    assert len(report["cells"]) == len(variants) * len(groups)
    # measured: the embedded tiny model answers one of the first four shapes test rows before training
    assert report["accuracy_before"] == 0.25 and report["wall_seconds"] > 0
    for cell in report["cells"]:
        assert cell["completions_sampled"] == [settings["budget"]] * len(seeds)  # the same budget in every cell
        assert len(cell["accuracy_after"]) == len(seeds)
        assert cell["accuracy_std"] == pytest.approx(statistics.stdev(cell["accuracy_after"]))
        assert len(cell["completions_to_target"]) == len(seeds)
    for run in report["runs"]:
        assert run["curve"][-1]["completions"] == settings["budget"]
        if "trainer.beta_th=0" in run["overrides"]:  # one rollout per step: budget / (B x G) steps
            assert run["steps"] == settings["budget"] // (settings["batch_size"] * run["group_size"])
        if "trainer.age=false" in run["overrides"]:
            assert {p["alpha"] for p in run["curve"]} <= {0.0, 1.0}
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {v} |" in table for v in variants) and "G=2" in table
    assert [p["variant"] for p in report["paired_vs_gpg"]] == [v for v in variants if v != "gpg"]
    # the stored runs re-summarised for another target, without training again
    again = procs.run(["scripts/ablate.py", "--from-json", str(tmp_path / "ablation.json"), "--target", "0.99",
                       "--out", str(tmp_path / "again")], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    resummarised = json.loads((tmp_path / "again" / "ablation.json").read_text())
    assert resummarised["runs"] == report["runs"] and resummarised["settings"]["target"] == 0.99
    assert resummarised["settings"]["budget"] == settings["budget"]


# ----------------------------------------------------------------------------- scripts/grad_variance.py
def test_relative_variance_by_hand():
    relative_variance = load_script("grad_variance").relative_variance
    # rows (1, 0), (3, 0): mean (2, 0); squared distances 1 and 1 -> 1; |mean|^2 = 4 -> 0.25
    assert relative_variance(torch.tensor([[1.0, 0.0], [3.0, 0.0]])) == pytest.approx(0.25)
    # rows (1, 1), (-1, 1), (0, 4): mean (0, 2); distances 2, 2, 4 -> 8/3; |mean|^2 = 4 -> 2/3
    assert relative_variance(torch.tensor([[1.0, 1.0], [-1.0, 1.0], [0.0, 4.0]])) == pytest.approx(2 / 3)
    assert relative_variance(torch.ones(5, 3)) == 0.0  # no spread
    assert relative_variance(torch.tensor([[1.0], [-1.0]])) == float("inf")  # no mean


def test_grad_variance_machinery(tmp_path, capsys):
    script = load_script("grad_variance")
    assert script.main(["--batches", "2", "--groups", "2", "--prompts", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "grad_variance.json").read_text())
    assert set(report["results"]) == {"none/G=2", "group_mean/G=2", "std_normalized/G=2"}
    for entry in report["results"].values():
        assert entry["mean_squared_distance"] > 0  # two batches of sampled completions give different gradients
        spread, signal = entry["mean_squared_distance"], entry["mean_grad_norm"] ** 2
        assert entry["relative_variance"] == pytest.approx(spread / signal)
        assert entry["largest_batch_share"] == pytest.approx(0.5)  # K = 2: both batches are equally far
    assert (tmp_path / "grad_variance.png").stat().st_size > 0
    assert "| group_mean |" in capsys.readouterr().out
