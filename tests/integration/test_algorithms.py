"""The GRPO family in the trainer: presets, mu epochs over one rollout, old and reference log-probs, exact resume."""

import json

import pytest
import torch
from helpers.runs import untimed
from helpers.scoring import on_every_scoring
from transformers import AutoModelForImageTextToText, PreTrainedModel

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.train.loop import RunSettings, setup_policy, train

TINY = ["task=shapes", "model=tiny", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4",
        "trainer.group_size=4", "rollout.max_new_tokens=16"]


def lines(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_presets_print_their_values_and_every_key_stays_overridable(capsys):
    assert run_cli("train", train_main, ["algorithm=grpo", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    for line in ("loss: grpo", "advantage: std_normalized", "kl_coef: 0.04", "clip_low: 0.2", "age: false",
                 "beta_th: 0.0", "ppo_epochs: 1"):
        assert f"  {line}\n" in printed
    dapo = load_config("train", ["algorithm=dapo"]).trainer
    assert (dapo.loss, dapo.clip_high, dapo.aggregation, dapo.beta_th, dapo.kl_coef) == ("dapo", 0.28, "token_mean",
                                                                                          1.0, 0.0)
    dr = load_config("train", ["algorithm=dr_grpo"]).trainer
    assert (dr.loss, dr.advantage, dr.aggregation, dr.kl_coef) == ("dr_grpo", "group_mean", "seq_mean_token_sum", 0)
    gpg = load_config("train", []).trainer
    assert (gpg.loss, gpg.advantage, gpg.age, gpg.kl_coef, gpg.beta_th) == ("gpg", "group_mean", True, 0.0, 0.4)
    over = load_config("train", ["algorithm=grpo", "trainer.ppo_epochs=3", "trainer.kl_coef=0"]).trainer
    assert (over.ppo_epochs, over.kl_coef) == (3, 0.0)
    with pytest.raises(UserError, match="unknown algorithm 'ppo'; known: dapo, dr_grpo, gmpo, gpg, grpo, gspo, luspo, "
                                        "sapo, vespo"):
        load_config("train", ["algorithm=ppo"])
    with pytest.raises(UserError, match="trainer.kl_coef=0.1 needs a loss with a KL term"):
        load_config("train", ["trainer.kl_coef=0.1"])
    with pytest.raises(UserError, match="needs a loss with a ratio to the rollout policy"):
        load_config("train", ["trainer.ppo_epochs=2"])
    with pytest.raises(UserError, match="trainer.ppo_mini_batch=6 is not a multiple of trainer.group_size=4"):
        load_config("train", ["algorithm=grpo", "trainer.group_size=4", "trainer.ppo_mini_batch=6"])


@pytest.mark.parametrize("algorithm", ["gspo", "luspo", "sapo", "vespo", "gmpo", "bnpo"])
def test_each_2026_loss_trains_through_the_cli_with_ratios_that_move(tmp_path, algorithm):
    """Each preset (bnpo, which has none: as scripts/compare.py runs it) takes mu = 2 optimizer steps on one rollout,
    so its second step sees ratios away from 1; the loss stays finite and the weights change. (Resampling,
    beta_th 1, finds groups whose rewards differ.)"""
    picked = [f"algorithm={algorithm}"] if algorithm != "bnpo" else [
        "algorithm=grpo", "trainer.kl_coef=0", "trainer.loss=bnpo", "trainer.aggregation=token_mean"]
    summary = train_main(load_config("train", [*TINY, *picked, "trainer.max_steps=1", "trainer.ppo_epochs=2",
                                               "trainer.lr=1e-3", "trainer.beta_th=1", "trainer.max_attempts=8",
                                               f"output_dir={tmp_path}"]))
    (metrics,) = lines(tmp_path)
    assert summary["steps"] == 1 and metrics["optimizer_steps"] == 2.0
    assert metrics["loss"] == metrics["loss"] and abs(metrics["loss"]) < 1e6 and metrics["grad_norm"] > 0


def test_grpo_takes_mu_times_mini_batches_steps_and_scores_old_and_reference_once_per_rollout(tmp_path, policy,
                                                                                               shapes, monkeypatch):
    calls = []
    on_every_scoring(monkeypatch, lambda family, model, *a, **k: calls.append((torch.is_grad_enabled(), model)))
    settings = TrainerSettings(max_steps=2, group_size=4, batch_size=4, micro_batch_size=16, micro_batch_tokens=0,
                               lr=1e-3, eval_before=False, eval_after=False, beta_th=0.0,
                               advantage="std_normalized", loss="grpo", kl_coef=0.04, ppo_epochs=2,
                               ppo_mini_batch=8, age=False, lr_schedule="linear")
    train(setup_policy(policy, shapes, RunSettings(trainer=settings, rollout=RolloutSettings(max_new_tokens=16),
                                                   output_dir=tmp_path)))
    metrics = lines(tmp_path)
    for m in metrics:
        parts = -(-m["groups_used"] * 4 // 8)  # mini-batches of 8 sequences = 2 groups
        assert m["optimizer_steps"] == 2 * parts  # mu x (sequences / mini-batch)
        assert {"kl", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "ratio_max", "logp_drift"} <= set(m)
        assert m["kl"] >= 0 and m["ratio_max"] >= 1.0 - 1e-9
    # per micro-batch: one reference forward without gradient, once per rollout, then mu forwards with gradient; the
    # old log-probs of the first mini-batch's micro-batches come from the first step's own forward, those of the later
    # mini-batches from one forward without gradient each, once per rollout (train/step/before.py); the reference is
    # another model (the frozen copy)
    no_grad = [model for grad, model in calls if not grad]
    assert len({id(model) for model in no_grad}) == 2
    old = [model for model in no_grad if model is not no_grad[-1]]
    reference = len(no_grad) - len(old)
    assert len(old) == reference - len(metrics) > 0  # one micro-batch per mini-batch (micro_batch_size 16)
    assert sum(grad for grad, _ in calls) == 2 * reference
    # the schedule counts optimizer steps: linear decay over max_steps x mu x (B x G / mini-batch) = 2 x 2 x 2
    assert metrics[-1]["lr"] == pytest.approx(1e-3 * (1 - sum(m["optimizer_steps"] for m in metrics) / 8))
    # later steps moved the weights away from the rollout policy: a nonzero drift was measured
    assert any(abs(m["logp_drift"]) > 0 for m in metrics)


def test_gpg_keeps_one_forward_per_micro_batch_and_no_loss_report(tmp_path, policy, shapes, monkeypatch):
    calls = []
    on_every_scoring(monkeypatch, lambda *a, **k: calls.append(torch.is_grad_enabled()))
    trainer = TrainerSettings(max_steps=2, group_size=4, batch_size=4, micro_batch_tokens=0, micro_batch_size=4,
                              eval_before=False, eval_after=False, beta_th=0)
    train(setup_policy(policy, shapes, RunSettings(trainer, RolloutSettings(max_new_tokens=12), output_dir=tmp_path)))
    metrics = lines(tmp_path)
    assert all(calls) and len(calls) == sum(m["groups_used"] for m in metrics)  # 4 sequences = 1 group each
    assert all(m["optimizer_steps"] == (1.0 if m["groups_used"] else 0.0) for m in metrics if "optimizer_steps" in m)
    assert not {"kl", "ratio_mean", "logp_drift"} & set(metrics[0])


def test_with_lora_the_reference_is_the_base_model_with_adapters_disabled(tmp_path, monkeypatch):
    built = []
    original_init = PreTrainedModel.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", counting_init)
    AutoModelForImageTextToText.from_pretrained("gpg_vl/assets/tiny-qwen2.5-vl")
    one_model = list(built)
    built.clear()
    import peft

    disabled = []
    real = peft.PeftModel.disable_adapter

    def spying(self):
        disabled.append(1)
        return real(self)

    monkeypatch.setattr(peft.PeftModel, "disable_adapter", spying)
    train_main(load_config("train", [f"output_dir={tmp_path}", *TINY, "algorithm=grpo", "trainer.max_steps=2",
                                     "trainer.beta_th=1", "model.lora.r=4", "trainer.lr=1e-3"]))
    assert built == one_model  # no second copy of the model
    assert len(disabled) == sum(m["groups_used"] > 0 for m in lines(tmp_path)) > 0
    kl = [m["kl"] for m in lines(tmp_path) if "kl" in m]
    assert kl[0] == pytest.approx(0.0, abs=1e-12)  # before any step the adapters are zero: policy == reference


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_a_grpo_family_run_resumes_bit_exactly(tmp_path, algorithm):
    common = [*TINY, f"algorithm={algorithm}", "trainer.max_steps=3", "trainer.save_every=1", "trainer.lr=1e-3",
              "trainer.keep_checkpoints=5", "trainer.ppo_epochs=2", "trainer.ppo_mini_batch=8",
              "trainer.max_attempts=3", "trainer.overlong_cache=4"]
    train_main(load_config("train", [f"output_dir={tmp_path / 'full'}", *common]))
    train_main(load_config("train", [f"output_dir={tmp_path / 'resumed'}", *common,
                                     f"resume={tmp_path / 'full' / 'checkpoint-1'}"]))
    full = AutoModelForImageTextToText.from_pretrained(tmp_path / "full" / "final").state_dict()
    resumed = AutoModelForImageTextToText.from_pretrained(tmp_path / "resumed" / "final").state_dict()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert [untimed(m) for m in lines(tmp_path / "full")[1:]] == [untimed(m) for m in lines(tmp_path / "resumed")]
    assert sum(m["optimizer_steps"] for m in lines(tmp_path / "resumed")) > 0
    assert "reward/overlong" in lines(tmp_path / "full")[0]
