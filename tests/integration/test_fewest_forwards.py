"""The update forwards each micro-batch the fewest times (gpg_vl/train/step/before.py): the policy's log-probs before
the update (pi_prox: the ratio's "old" log-probs with several optimizer steps, the student's log-probs a teacher's
advantages read) come from the first optimizer step's own forward, not from forwards without gradient before it. The
forwards of the policy are counted per micro-batch against the path that scores pi_prox apart
(`Learner.share_first_forward=False`), and the losses, gradients and teacher figures of both paths are the same."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.learners import learner_for
from helpers.scoring import on_every_scoring

from gpg_vl.config.schema import RolloutSettings, TeacherSettings, TrainerSettings
from gpg_vl.rollout.engine import build_engine
from gpg_vl.train.step.sample import sample_attempt
from gpg_vl.train.step.update import update
from gpg_vl.train.teacher.build import Teachers
from gpg_vl.train.teacher.local import frozen_teacher

GRPO_2 = dict(loss="grpo", aggregation="seq_mean_token_mean", clip_low=0.2, clip_high=None, kl_coef=0.0,
              ppo_epochs=2, age=False)  # configs/algorithm/grpo.yaml (its KL off: no reference) with 2 epochs


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the flattened gradient of each of its steps."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]
                                     if p.grad is not None]))
        return super().step(closure)


@pytest.fixture()
def drawn(policy, shapes):
    from gpg_vl.data.stream import PromptStream

    stream = PromptStream(shapes.load("train"), seed=0)
    rollout = RolloutSettings(max_new_tokens=6)
    attempt = sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                             trainer=TrainerSettings(batch_size=3, group_size=2, reward_workers=1), warn=print)
    advantages = torch.randn(attempt.rewards.shape, generator=torch.Generator().manual_seed(1))  # [b, G]
    valid = torch.tensor([True, False, True])
    return dataclasses.replace(attempt, advantages=torch.where(valid.unsqueeze(1), advantages, 0.0), valid=valid,
                               task=None)


def _teacher(policy, settings, noise: float):
    """The policy moved by `noise` (0: the student itself) as a local reverse_kl teacher of the run's one task."""
    model = copy.deepcopy(policy.model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return Teachers({None: frozen_teacher(model, policy.family, TeacherSettings(model="noisy", coef=0.5), settings)})


def _run(policy, attempt, settings, teacher, *, share: bool, monkeypatch):
    """One update of a fresh copy of the policy: (its metrics, each optimizer step's gradient, the policy's forwards
    per micro-batch, the weights after it)."""
    model = copy.deepcopy(policy.model)
    optimizer = RecordingSGD(model.parameters(), lr=1e-3)
    forwards = []
    on_every_scoring(monkeypatch, lambda family, scorer, *a, **k: forwards.append(scorer is model))
    learner = learner_for(policy, settings, model=model, optimizer=optimizer, teacher=teacher,
                          share_first_forward=share)
    attempt = dataclasses.replace(attempt, rollout=copy.deepcopy(attempt.rollout))
    result = update(learner, [attempt])
    sequences = attempt.advantages.numel() if teacher is not None else int(attempt.valid.sum()) * settings.group_size
    micro_batches = -(-sequences // settings.micro_batch_size)  # a teacher's task forwards every group
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return result, optimizer.grads, sum(forwards) / micro_batches, weights


@pytest.mark.parametrize(("name", "overrides", "with_teacher", "shared", "apart"), [
    ("teacher", {}, True, 1, 2),  # 7175d10: 2 (the teacher's student forward, then the update's)
    ("grpo2", GRPO_2, False, 2, 3),  # 7175d10: 3 (the old log-probs, then two epochs)
    ("teacher_grpo2", GRPO_2, True, 2, 3),  # 7175d10: 4 (the teacher's student forward and the old log-probs apart)
])
def test_each_micro_batch_is_forwarded_the_fewest_times_and_trains_the_same(policy, drawn, monkeypatch, name,
                                                                              overrides, with_teacher, shared, apart):
    settings = TrainerSettings(batch_size=3, group_size=2, micro_batch_size=2, micro_batch_tokens=0,
                               max_grad_norm=1e9, **overrides)
    teacher = _teacher(policy, settings, 0.05) if with_teacher else None
    runs = {share: _run(policy, drawn, settings, teacher, share=share, monkeypatch=monkeypatch)
            for share in (True, False)}
    (result, grads, forwards, weights), (result_apart, grads_apart, forwards_apart, weights_apart) = \
        runs[True], runs[False]
    assert (forwards, forwards_apart) == (shared, apart)
    assert len(grads) == len(grads_apart) == settings.ppo_epochs
    for grad, grad_apart in zip(grads, grads_apart, strict=True):
        assert grad.abs().max() > 0
        assert torch.allclose(grad, grad_apart, rtol=1e-6, atol=1e-9)
    assert torch.allclose(weights, weights_apart, rtol=1e-6, atol=1e-9)
    assert result.keys() == result_apart.keys()
    for key, value in result.items():
        assert value == pytest.approx(result_apart[key], rel=1e-6, abs=1e-9), key
    if with_teacher:
        assert result["teacher_kl"] > 0 and result["groups_used"] == 3


def test_a_teacher_that_leaves_a_group_out_of_the_first_step_runs_it_again(policy, drawn, monkeypatch):
    """A teacher equal to the student adds nothing to the advantages: the invalid group stays all zero and is left
    out of AGE's normalizer, which the first step learns from its own forward; it then runs again (one more forward
    per micro-batch, only then) and trains as the path that scores the teacher's student log-probs apart."""
    settings = TrainerSettings(batch_size=3, group_size=2, micro_batch_size=2, micro_batch_tokens=0,
                               max_grad_norm=1e9)
    teacher = _teacher(policy, settings, 0.0)
    (result, grads, forwards, weights) = _run(policy, drawn, settings, teacher, share=True, monkeypatch=monkeypatch)
    (result_apart, grads_apart, forwards_apart, weights_apart) = _run(policy, drawn, settings, teacher, share=False,
                                                                      monkeypatch=monkeypatch)
    assert (forwards, forwards_apart) == (2, 2)
    assert result["groups_used"] == result_apart["groups_used"] == 2  # the invalid group left out
    assert len(grads) == len(grads_apart) == 1
    assert torch.allclose(grads[0], grads_apart[0], rtol=1e-6, atol=1e-9)
    assert torch.allclose(weights, weights_apart, rtol=1e-6, atol=1e-9)
    for key, value in result.items():
        assert value == pytest.approx(result_apart[key], rel=1e-6, abs=1e-9), key
