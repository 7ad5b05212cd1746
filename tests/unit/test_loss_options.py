"""A loss declares its options in its signature; objective.loss_options fills them from trainer.loss_options,
then the trainer setting of that name (or max_tokens), then the loss's own default."""

import pytest

from gpg_vl.errors import UserError
from gpg_vl.objective import declared_options, get_policy_loss, loss_options

TRAINER = {"clip_low": 0.2, "clip_high": None, "kl_coef": 0.0, "max_tokens": 16}  # what update() passes


def test_a_declared_option_takes_the_given_value_then_the_trainer_setting_then_its_default():
    dapo = get_policy_loss("dapo")
    assert declared_options(dapo) == {"clip_low": 0.2, "clip_high": 0.28, "off_policy_mask_threshold": None}
    # trainer.clip_high is a trainer setting (null): it is passed, as before loss_options existed
    assert loss_options(dapo, {}, TRAINER)["clip_high"] is None
    assert loss_options(dapo, {"clip_high": 0.3}, TRAINER)["clip_high"] == 0.3
    assert loss_options(dapo, {}, {})["clip_high"] == 0.28  # no trainer setting: the loss's own default
    dr_grpo = loss_options(get_policy_loss("dr_grpo"), {"max_tokens": 8}, TRAINER)
    assert dr_grpo["max_tokens"] == 8 and dr_grpo["clip_low"] == 0.2


def test_a_loss_that_forwards_keywords_still_gets_the_trainer_settings_it_does_not_declare():
    gpg = get_policy_loss("gpg")  # declares max_tokens, forwards **options
    assert loss_options(gpg, {}, TRAINER) == TRAINER
    assert loss_options(get_policy_loss("grpo"), {"kl_coef": 0.04}, TRAINER)["kl_coef"] == 0.04


def test_an_option_the_loss_does_not_declare_fails_in_one_sentence_naming_the_loss_and_its_options():
    with pytest.raises(UserError) as error:
        loss_options(get_policy_loss("dapo"), {"kl_coef": 0.1}, TRAINER, name="dapo")
    message = str(error.value)
    assert "trainer.loss_options.kl_coef" in message and "dapo" in message and "clip_high, clip_low" in message
    assert "\n" not in message


def test_a_plugin_loss_declares_its_own_option(tmp_path):
    plugin = tmp_path / "my_loss.py"
    plugin.write_text(
        "def scaled(token_logps, completion_mask, advantages, *, old_logps=None, ref_logps=None,\n"
        "           aggregation='seq_mean_token_mean', normalizer=None, scale: float = 1.0):\n"
        "    return (-(token_logps * completion_mask).sum() * scale, {})\n")
    loss = get_policy_loss(f"{plugin}:scaled")
    assert declared_options(loss) == {"scale": 1.0}
    assert loss_options(loss, {}, TRAINER) == {"scale": 1.0}  # no **kwargs: the trainer's settings stay out
    assert loss_options(loss, {"scale": 2.5}, TRAINER) == {"scale": 2.5}
    with pytest.raises(UserError, match="its options: scale"):
        loss_options(loss, {"scael": 2.5}, TRAINER)


def test_the_trainer_checks_loss_options_against_trainer_loss():
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.train.loss_call import trainer_loss_options

    assert trainer_loss_options(TrainerSettings(loss="grpo", loss_options={"clip_low": 0.1}), 32)["clip_low"] == 0.1
    with pytest.raises(UserError, match="loss gpg has no option 'clip_low'"):
        trainer_loss_options(TrainerSettings(loss_options={"clip_low": 0.1}), 32)


def test_an_unknown_loss_option_fails_on_the_command_line_before_anything_loads(tmp_path, monkeypatch):
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("gpg_vl.train.build.build_policy", refuse)
    monkeypatch.setattr("gpg_vl.train.build.build_task", refuse)
    with pytest.raises(UserError, match="trainer.loss_options.clip_lo: loss grpo has no option 'clip_lo'"):
        train_main(load_config("train", [f"output_dir={tmp_path}", "algorithm=grpo", "trainer.loss_options.clip_lo=1"]))
    assert not (tmp_path / "config.json").exists()
