"""The frozen reference of a loss with a KL term (gpg_vl/train/step/reference.py's build_reference)."""

import pytest
import torch

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.train.step.reference import build_reference

KL = TrainerSettings(loss="grpo", kl_coef=0.04)


def test_the_reference_is_a_frozen_copy_of_the_initial_weights():
    model = torch.nn.Linear(3, 2)
    frozen = build_reference(model, KL, None, resuming=False).model
    assert frozen is not model and frozen.training is False
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(torch.equal(a, b) for a, b in zip(frozen.parameters(), model.parameters(), strict=True))
    assert build_reference(model, TrainerSettings(), None, resuming=False) is None  # GPG: no KL, no reference


def test_a_zero3_partitioned_model_is_not_copied_and_the_sentence_says_to_pass_the_reference():
    """Under ZeRO-3 a parameter is a shard that DeepSpeed tracks (it has a ds_id): a deep copy's shards belong to no
    engine, and its first forward fails deep inside the vision tower (`weight should have at least three
    dimensions`). The command line passes a second load of the model; the Python API is told to."""
    model = torch.nn.Linear(3, 2)
    for parameter in model.parameters():
        parameter.ds_id = 0  # what deepspeed.zero.Init sets on each partitioned parameter
    with pytest.raises(UserError) as error:
        build_reference(model, KL, None, resuming=False)
    message = str(error.value)
    assert "partitioned by DeepSpeed ZeRO-3 cannot be copied" in message and "pass reference=" in message
    assert "\n" not in message and message.endswith(".")
    given = torch.nn.Linear(3, 2)
    assert build_reference(model, KL, given, resuming=False).model is given  # a reference passed in is used
