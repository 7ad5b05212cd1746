"""GRPO's KL on groups without signal, as TRL and R1-V run it: every sampled sequence is forwarded, the invalid
groups with zero advantages (only the k3 KL acts on them), the loss the per-sequence token mean over ALL sampled
sequences, and a step is taken when no group is valid. The update's loss and gradient are checked against TRL
1.16's own `GRPOTrainer._compute_loss` (called on a stand-in trainer, on the same log-probs)."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers.learners import learner_for
from helpers.scoring import on_every_scoring, token_logps

from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.models import scoring
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.rollout.engine import build_engine
from gpg_vl.train.step.reference import Reference, kl_on_every_group
from gpg_vl.train.step.sample import sample_attempt
from gpg_vl.train.step.update import update

BETA = 0.04


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the flattened gradient of its last step."""

    def step(self, closure=None):
        self.grad = torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]
                               if p.grad is not None])
        return super().step(closure)


def trl_loss(per_token_logps, ref_logps, completion_mask, advantages, *, beta=BETA, epsilon=0.2):
    """TRL's `GRPOTrainer._compute_loss` (loss_type "grpo", num_iterations 1, one accumulation step), run on a
    stand-in trainer whose per-token log-prob function returns `per_token_logps` [N, C] (with gradient)."""
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer

    n, width = per_token_logps.shape
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (per_token_logps,
                                                                     torch.zeros_like(per_token_logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None), loss_type="grpo", epsilon_low=epsilon,
        epsilon_high=epsilon, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=Accelerator(cpu=True), _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, width, dtype=torch.long),
              "completion_mask": completion_mask.to(per_token_logps.dtype), "advantages": advantages,
              "ref_per_token_logps": ref_logps}
    return GRPOTrainer._compute_loss(stand_in, None, inputs), stand_in._metrics["train"]


@pytest.fixture()
def drawn(policy, shapes):
    from gpg_vl.data.stream import PromptStream

    stream = PromptStream(shapes.load("train"), seed=0)
    rollout = RolloutSettings(max_new_tokens=8)
    return sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                          trainer=TrainerSettings(batch_size=3, group_size=2, reward_workers=1), warn=print)


def _attempt(attempt, valid: list[bool], seed: int):
    """The same completions with chosen valid groups and random advantages on them (zero elsewhere)."""
    valid = torch.tensor(valid)
    advantages = torch.randn(attempt.rewards.shape, generator=torch.Generator().manual_seed(seed))  # [b, G]
    return dataclasses.replace(attempt, advantages=torch.where(valid.unsqueeze(1), advantages, 0.0), valid=valid)


def _reference(model):
    """A reference 1% away from the policy, so the KL and its gradient are not zero."""
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return reference.requires_grad_(False).eval()


@pytest.mark.parametrize("valid", [[True, False, True], [False, True, False], [False, False, False]],
                         ids=["two-valid", "one-valid", "none-valid"])
def test_grpo_update_equals_trl_compute_loss_with_invalid_groups(policy, drawn, valid):
    pytest.importorskip("trl")

    attempt = _attempt(drawn, valid, seed=1)
    reference = _reference(policy.model)
    settings = TrainerSettings(loss="grpo", advantage="std_normalized", kl_coef=BETA, age=False, beta_th=0.0,
                               batch_size=3, group_size=2, micro_batch_size=4, micro_batch_tokens=0,
                               max_grad_norm=1e9)
    assert kl_on_every_group(settings)
    model = copy.deepcopy(policy.model)
    optimizer = RecordingSGD(model.parameters(), lr=1.0)
    path = choose_scoring_path(policy.family, model, share_prompt=settings.share_prompt,
                               share_vision=settings.share_vision)
    learner = learner_for(policy, settings, model=model, optimizer=optimizer, path=path,
                          reference=Reference(reference))
    # TRL on every sampled sequence, from the same weights (before the update's step)
    expected_model = copy.deepcopy(policy.model)
    rollout = attempt.rollout
    everything = list(range(rollout.completion_ids.shape[0]))
    mask = rollout.completion_mask

    def logps(scorer):
        return token_logps(policy.family, scorer, attempt.prompts, [s // 2 for s in everything],
                           rollout.completion_ids, mask, temperature=1.0, path=path)

    with torch.no_grad():
        ref_logps = logps(reference)
    expected, trl_metrics = trl_loss(logps(expected_model), ref_logps, mask, attempt.advantages.flatten())
    expected.backward()
    expected_grad = torch.cat([p.grad.flatten() for p in expected_model.parameters() if p.grad is not None])

    result = update(learner, [attempt])

    assert result["loss"] == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-8)
    assert torch.allclose(optimizer.grad, expected_grad, rtol=1e-4, atol=1e-7)
    assert optimizer.grad.abs().max() > 0  # the KL pulls even where no group is valid
    # the k3 estimate exp(d) - d - 1 of a gap d ~ 1e-2 cancels in float32 to ~1e-7 per token, whichever of two
    # equal formulas runs (2.2e-5 relative on AMD EPYC against TRL's; rel 1e-5 held where it was written): an
    # absolute tolerance, not a relative one
    assert result["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5, abs=1e-6)
    # what happened: every group forwarded, the invalid ones for their KL alone, one optimizer step, alpha 1
    assert (result["groups_used"], result["groups_kl_only"]) == (3, valid.count(False))
    assert (result["skipped"], result["optimizer_steps"], result["alpha"]) == (0.0, 1.0, 1.0)


def test_grpo_with_the_kl_off_and_gpg_still_skip_invalid_groups(policy, drawn, monkeypatch):

    attempt = _attempt(drawn, [True, False, False], seed=2)
    for settings in (TrainerSettings(loss="grpo", kl_coef=0.0, age=False, batch_size=3, group_size=2),
                     TrainerSettings(batch_size=3, group_size=2)):
        assert not kl_on_every_group(settings)
        forwarded = []
        model = copy.deepcopy(policy.model)
        on_every_scoring(monkeypatch, lambda family, scorer, prompts, prompt_index, *a, _seen=forwarded, **k:
                         _seen.append(len(prompt_index)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        path = scoring.choose_scoring_path(policy.family, model, share_prompt=settings.share_prompt,
                                           share_vision=settings.share_vision)
        result = update(learner_for(policy, settings, model=model, optimizer=optimizer, path=path), [attempt])
        assert sum(forwarded) == 2 and "groups_kl_only" not in result  # the one valid group's 2 sequences
        empty = update(learner_for(policy, settings, model=model, optimizer=optimizer, path=path),
                       [_attempt(drawn, [False] * 3, seed=3)])
        assert empty["skipped"] == 1.0


NO_SIGNAL = ("import torch\n"
             "def none_valid(rewards):\n"
             "    return torch.zeros_like(rewards), torch.zeros(rewards.shape[0], dtype=torch.bool)\n")


@pytest.mark.parametrize("algorithm", ["grpo", "gpg"])
def test_a_step_without_valid_groups_steps_on_the_kl_alone(tmp_path, algorithm):
    """Through the command line: an advantage that finds no signal anywhere. GRPO (KL on) still steps, every
    group forwarded for its KL; GPG skips the step, as before."""
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    plugin = tmp_path / "no_signal.py"
    plugin.write_text(NO_SIGNAL)
    train_main(load_config("train", [
        "task=shapes", "model=tiny", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=2",
        "trainer.group_size=2", "rollout.max_new_tokens=8", "trainer.max_steps=1", f"algorithm={algorithm}",
        "trainer.beta_th=0", f"trainer.advantage={plugin}:none_valid", f"output_dir={tmp_path / 'run'}"]))
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    if algorithm == "grpo":
        assert (metrics["groups_used"], metrics["groups_kl_only"], metrics["optimizer_steps"]) == (2, 2, 1.0)
        assert metrics["skipped"] == 0.0 and metrics["kl"] == pytest.approx(0.0, abs=1e-12)  # policy == reference
    else:
        assert (metrics["groups_used"], metrics["skipped"]) == (0, 1.0) and "groups_kl_only" not in metrics
