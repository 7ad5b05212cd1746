"""A loss declares its options in its signature; objective.loss_options fills them from trainer.loss_options,
then the trainer setting of that name (or max_tokens), then the loss's own default."""

import math

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


@pytest.mark.parametrize(("loss", "options", "allowed"), [
    ("gspo", {"clip_low": -1}, "a number >= 0 and < 1"), ("dapo", {"clip_high": 1.0}, "a number >= 0 and < 1 or null"),
    ("grpo", {"clip_low": math.nan}, "a number >= 0 and < 1"), ("cispo", {"cap": -1}, "a number > 0"),
    ("cispo", {"cap": 0}, "a number > 0"), ("cispo", {"cap": "abc"}, "a number > 0"),
    ("sapo", {"temperature_pos": 0}, "a number > 0"), ("sapo", {"temperature_neg": -1.05}, "a number > 0"),
    ("vespo", {"lambda_pos": 0}, "a number > 0"), ("dr_grpo", {"max_tokens": 0}, "an integer >= 1"),
    ("dr_grpo", {"max_tokens": None}, "an integer >= 1"), ("gpg", {"max_tokens": -16}, "an integer >= 1"),
    ("gpg", {"max_tokens": 0}, "an integer >= 1")])
def test_a_loss_option_outside_its_declared_range_or_of_the_wrong_type_fails_naming_the_option(loss, options,
                                                                                                allowed):
    with pytest.raises(UserError) as error:
        loss_options(get_policy_loss(loss), options, TRAINER, name=loss)
    (key, value), = options.items()
    message = str(error.value)
    assert message.startswith(f"trainer.loss_options.{key}={value!r} is not allowed for loss {loss}: give {allowed} ("
                              ) and "\n" not in message and "must return" not in message, message


def test_a_plugin_losss_options_are_checked_only_as_far_as_it_declares_them(tmp_path):
    plugin = tmp_path / "ranged_loss.py"
    plugin.write_text(
        "from typing import Annotated\n"
        "from gpg_vl.config.keys import option\n"
        "def ranged(token_logps, completion_mask, advantages, *, old_logps=None, ref_logps=None,\n"
        "           aggregation='seq_mean_token_mean', normalizer=None,\n"
        "           scale: Annotated[float, option('the loss scale', above=0, high=10)] = 1.0, free=1.0,\n"
        "           typed: int = 2):\n"
        "    return (-(token_logps * completion_mask).sum() * scale, {})\n")
    loss = get_policy_loss(f"{plugin}:ranged")
    assert loss_options(loss, {"scale": 10, "free": "anything", "typed": 3}, TRAINER) == {
        "scale": 10, "free": "anything", "typed": 3}  # an option with no declared range still works
    with pytest.raises(UserError, match=r"^trainer.loss_options.scale=11 is not allowed for loss ranged: give a "
                                        r"number > 0 and <= 10 \(the loss scale\)\.$"):
        loss_options(loss, {"scale": 11}, TRAINER)
    with pytest.raises(UserError, match=r"^trainer.loss_options.typed=2.5 is not allowed for loss ranged: give an "
                                        r"integer\.$"):
        loss_options(loss, {"typed": 2.5}, TRAINER)


def test_the_trainer_checks_loss_options_against_trainer_loss():
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.train.step.loss_call import trainer_loss_options

    assert trainer_loss_options(TrainerSettings(loss="grpo", loss_options={"clip_low": 0.1}), 32)["clip_low"] == 0.1
    with pytest.raises(UserError, match="loss gpg has no option 'clip_low'"):  # as the settings are read
        trainer_loss_options(TrainerSettings(loss_options={"clip_low": 0.1}), 32)
    with pytest.raises(UserError, match="trainer.loss_options.clip_low=-1 is not allowed for loss gspo"):
        TrainerSettings(loss="gspo", aggregation="seq_mean_token_mean", loss_options={"clip_low": -1})


def test_an_unknown_loss_option_fails_on_the_command_line_before_anything_loads(tmp_path, monkeypatch):
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("gpg_vl.train.build.build_policy", refuse)
    monkeypatch.setattr("gpg_vl.train.build.build_task", refuse)
    with pytest.raises(UserError, match="trainer.loss_options.clip_lo: loss grpo has no option 'clip_lo'"):
        train_main(load_config("train", [f"output_dir={tmp_path}", "algorithm=grpo", "trainer.loss_options.clip_lo=1"]))
    with pytest.raises(UserError, match="trainer.loss_options.cap='abc' is not allowed for loss cispo"):
        train_main(load_config("train", [f"output_dir={tmp_path}", "algorithm=dapo", "trainer.loss=cispo",
                                         "trainer.loss_options.cap=abc"]))
    assert not (tmp_path / "config.json").exists()


def test_a_loss_with_a_fixed_aggregation_names_a_preset_only_where_one_exists():
    from gpg_vl.config.schema import TrainerSettings

    with pytest.raises(UserError) as error:
        TrainerSettings(loss="gspo", aggregation="token_mean")
    assert str(error.value) == ("trainer.loss=gspo aggregates as seq_mean_token_mean; set trainer.aggregation="
                                "seq_mean_token_mean (algorithm=gspo sets both).")
    for loss in ("bnpo", "cispo"):  # no configs/algorithm/<loss>.yaml
        with pytest.raises(UserError) as error:
            TrainerSettings(loss=loss)
        assert str(error.value) == (f"trainer.loss={loss} aggregates as token_mean; set trainer.aggregation="
                                    f"token_mean (there is no algorithm={loss} preset: give both settings).")
        assert TrainerSettings(loss=loss, aggregation="token_mean").loss == loss  # what the sentence says works


def test_every_option_of_every_loss_advantage_aggregation_and_correction_declares_its_range():
    """A new option of a built-in cannot land without `Annotated[..., option(meaning, low=..)]`: a negative
    gpg max_tokens once turned the loss into gradient ascent (issue 59)."""
    from gpg_vl.config.names import ADVANTAGE_BUILTINS, CORRECTION_BUILTINS, LOSS_BUILTINS
    from gpg_vl.config.rules import undeclared_options
    from gpg_vl.objective import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from gpg_vl.objective.aggregation import AGGREGATION_INPUTS, AGGREGATIONS
    from gpg_vl.objective.corrections import CORRECTION_INPUTS, CORRECTIONS
    from gpg_vl.objective.options import LOSS_INPUTS

    kinds = [(POLICY_LOSSES.load_all(), LOSS_INPUTS), (ADVANTAGE_ESTIMATORS.load_all(), ("rewards",)),
             (AGGREGATIONS, AGGREGATION_INPUTS), (CORRECTIONS.load_all(), CORRECTION_INPUTS)]
    for table, inputs in kinds:
        for name, fn in table.items():
            assert undeclared_options(fn, inputs) == [], name
    assert set(kinds[0][0]) >= set(LOSS_BUILTINS) and set(kinds[1][0]) >= set(ADVANTAGE_BUILTINS)
    assert set(kinds[3][0]) >= set(CORRECTION_BUILTINS) and len(AGGREGATIONS) == 4
    assert undeclared_options(get_policy_loss("gpg"), LOSS_INPUTS) == [] and \
        "max_tokens" in declared_options(get_policy_loss("gpg"))


def test_the_walk_finds_an_option_without_a_range():
    from typing import Annotated

    from gpg_vl.config.keys import option
    from gpg_vl.config.rules import undeclared_options

    def plugin(x, *, plain: int = 3, unbounded: Annotated[float, option("a scale")] = 1.0,
               ranged: Annotated[float, option("a scale", above=0)] = 1.0, flag: bool = False,
               choice: Annotated[str, option("a mode", choices=("a", "b"))] = "a"):
        return x

    assert undeclared_options(plugin, ("x",)) == ["plain", "unbounded"]


def test_a_negative_or_zero_max_tokens_fails_as_the_settings_are_read():
    from gpg_vl.config.schema import TrainerSettings

    for value in (-16, 0):
        with pytest.raises(UserError, match=rf"^trainer.loss_options.max_tokens={value} is not allowed for loss gpg: "
                                            r"give an integer >= 1 \("):
            TrainerSettings(aggregation="seq_mean_token_sum", loss_options={"max_tokens": value})


def test_the_reference_names_every_built_in_loss():
    """docs/configuration.md's trainer.loss row named 4 of the built-in losses (issue 59)."""
    from dataclasses import fields

    from gpg_vl.config.names import LOSS_BUILTINS
    from gpg_vl.config.schema import TrainerSettings

    (loss,) = [item for item in fields(TrainerSettings) if item.name == "loss"]
    meaning = loss.metadata["key"].help
    assert all(f" {name}," in meaning or f" {name} " in meaning for name in LOSS_BUILTINS), meaning
