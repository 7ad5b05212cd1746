"""A `Learner` (gpg_vl/train/step/update.py) built the way the update tests need one: the policy's model (or another),
plain SGD at lr 0 unless given an optimizer, a constant schedule, a CPU accelerator, and the scoring path a run with
these settings chooses at setup; any other field (reference, correction, temperature, ...) by keyword."""

from __future__ import annotations

import dataclasses

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from gpg_vl.train.step.update import Learner
from helpers.scoring import path_for


def learner_for(policy, settings, *, model=None, optimizer=None, scheduler=None, accelerator=None,
                temperature: float = 1.0, **fields) -> Learner:
    """A Learner of `policy` (its model replaced by `model` when given) with trainer `settings`."""
    model = policy.model if model is None else model
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = scheduler or get_scheduler("constant", optimizer)
    if model is not policy.model:
        policy = dataclasses.replace(policy, model=model)
    return Learner(policy, model, optimizer, scheduler, accelerator or Accelerator(cpu=True), settings,
                   temperature=temperature, path=fields.pop("path", None) or path_for(policy.family, model, settings),
                   **fields)
