"""trainer.max_staleness: the sampler beside the learner (gpg_vl/train/step/pipeline.py). At k = 1 the same seed gives
the same weights and metrics; a run stopped after a checkpoint, with a step in flight, resumes to the uninterrupted run;
the HF engine's behaviour log-probs are the update's own; the update's normalizer and alpha leave rejected sequences out
as a hand computation says; impossible settings are refused before the model loads."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers.learners import learner_for
from helpers.runs import train_run, untimed
from safetensors.torch import load_file

from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.models import scoring
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts
from gpg_vl.train.step.sample import sample_attempt

SMALL = ["trainer.max_staleness=1", "seed=0"]  # on tests/helpers/runs.py's QUICK_RUN: B = 4, G = 4, 16 tokens


def _metrics(folder) -> list[dict]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [untimed(m) for m in lines]


def _weights(folder) -> dict:
    return load_file(folder / "model.safetensors")


def _same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tensor_sums(tensors) -> list[float]:
    """Each distinct tensor's float64 sum, sorted: two sets of weights agree on it exactly when they are the same
    weights, whatever their names."""
    unique = {t.data_ptr(): t for t in tensors}.values()
    return sorted(float(t.detach().double().sum()) for t in unique)


def test_k1_is_deterministic_one_step_behind_and_resumes_a_step_in_flight_exactly(tmp_path, monkeypatch):
    """The second run also evaluates every 2 steps (trainer.eval_every): the same run, its evaluations in the lines
    of steps 2 and 4, each of the learner's weights after its step (the sampler's copy is older)."""
    from gpg_vl.train.eval import held_out

    evaluated_weights, original = [], held_out.evaluate

    def evaluate(policy, *args, **kwargs):
        evaluated_weights.append(_tensor_sums(policy.model.state_dict().values()))
        return original(policy, *args, **kwargs)

    first, second = tmp_path / "first", tmp_path / "second"
    train_run(first, "trainer.max_steps=4", "trainer.save_every=2", *SMALL)
    monkeypatch.setattr(held_out, "evaluate", evaluate)
    train_run(second, "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2", "eval.limit=4", *SMALL)
    monkeypatch.undo()
    assert evaluated_weights == [_tensor_sums(_weights(first / name).values()) for name in ("checkpoint-2", "final")]
    metrics = _metrics(first)
    assert [m["version_lag_max"] for m in metrics] == [0, 1, 1, 1]  # step n samples with the weights after n - 2
    evaluated = [{k: v for k, v in m.items() if k.startswith("eval_")} for m in _metrics(second)]
    assert [bool(e) for e in evaluated] == [False, True, False, True] and "eval_accuracy" in evaluated[3]
    assert [{k: v for k, v in m.items() if not k.startswith("eval_")} for m in _metrics(second)] == metrics
    assert _same_weights(_weights(first / "final"), _weights(second / "final"))
    assert not _same_weights(_weights(first / "final"), _weights(first / "checkpoint-2"))  # it trained
    # checkpoint-2 was written while step 3 was in flight: it holds the weights step 3 samples with (after step 1)
    assert (first / "checkpoint-2" / "sampler.safetensors").is_file()
    # a run stopped after checkpoint-2: its later checkpoints and lines gone; resume=auto continues it
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    for later in ("checkpoint-4", "final"):
        shutil.rmtree(resumed / later)
    (resumed / "summary.json").unlink()
    summary = train_run(resumed, "trainer.max_steps=4", "trainer.save_every=2", "resume=auto",
                        "trainer.eval_after=true", "eval.limit=4", *SMALL)
    assert _metrics(resumed) == metrics
    assert _same_weights(_weights(resumed / "final"), _weights(first / "final"))
    # the step-4 evaluation is the final weights' (eval_after's)
    assert evaluated[3] == {f"eval_{k}": v for k, v in summary["eval_after"].items() if isinstance(v, (int, float))}


def test_the_hf_engines_behaviour_logps_are_the_updates_at_the_sampling_temperature(policy, shapes):
    prompts = encode_prompts(policy, [shapes.messages(row) for row in shapes.load("train")[:2]])
    rollout = build_engine(RolloutSettings(max_new_tokens=6), policy).generate(
        prompts, 3, Sampling(max_new_tokens=6, temperature=0.7))
    path = choose_scoring_path(policy.family, policy.model, share_prompt=True, share_vision=True)
    with torch.no_grad():
        scored = scoring.token_logps(policy.family, policy.model, prompts.batch, [i // 3 for i in range(6)],
                                            rollout.completion_ids, rollout.completion_mask, temperature=0.7,
                                            path=path)
    mask = rollout.completion_mask
    assert rollout.sampler_logps is not None and rollout.sampler_logps.shape == mask.shape
    assert torch.allclose(rollout.sampler_logps[mask], scored[mask], atol=1e-4)


def test_rejected_sequences_leave_the_normalizer_and_all_rejected_groups_count_in_m(policy, shapes):
    """Three valid groups of two; the behaviour log-probs of group 0's first sequence and of both of group 1's are
    moved far off (geometric-mean rejection rejects them). By hand: normalizer = 3 kept sequences (group 0's second,
    group 2's two), M = 1 (group 1), and the loss is -1/3 sum over the kept of A_i x their token-mean log-prob."""

    from gpg_vl.data.stream import PromptStream
    from gpg_vl.train.step.update import update

    rollout = RolloutSettings(max_new_tokens=6)
    settings = TrainerSettings(batch_size=3, group_size=2, reward_workers=1, correction="geo_reject",
                               correction_options={"delta": 0.5}, micro_batch_tokens=0, micro_batch_size=2)
    attempt = sample_attempt(policy, shapes, PromptStream(shapes.load("train"), seed=0),
                             engine=build_engine(rollout, policy), rollout=rollout, trainer=settings, warn=print)
    advantages = torch.tensor([[0.5, -0.5], [1.0, -1.0], [0.25, -0.25]])
    behaviour = attempt.rollout.sampler_logps.clone()
    behaviour[[0, 2, 3]] -= 3.0  # ratios e^3 per token: rejected
    attempt = dataclasses.replace(attempt, advantages=advantages, valid=torch.ones(3, dtype=torch.bool),
                                  rollout=dataclasses.replace(attempt.rollout, sampler_logps=behaviour))
    path = choose_scoring_path(policy.family, policy.model, share_prompt=True, share_vision=True)
    with torch.no_grad():
        logps = scoring.token_logps(policy.family, policy.model, attempt.prompts, [0, 0, 1, 1, 2, 2],
                                           attempt.rollout.completion_ids, attempt.rollout.completion_mask,
                                           temperature=1.0, path=path)
    mask = attempt.rollout.completion_mask
    token_means = (logps * mask).sum(1) / mask.sum(1)
    kept = [1, 4, 5]
    expected = -sum(float(advantages.flatten()[i] * token_means[i]) for i in kept) / 3
    result = update(learner_for(policy, settings, path=path), [attempt])
    assert result["groups_rejected"] == 1 and result["rejected_fraction"] == pytest.approx(3 / 6)
    assert result["loss"] == pytest.approx(expected, abs=1e-6)


def test_settings_k1_cannot_run_with_are_refused_before_the_model_loads(tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from gpg_vl.config.compose import load_config
    from gpg_vl.train.step.pipeline import require_pipeline

    def launch(kind, stage=None):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=plugin))

    with pytest.raises(UserError, match="this launch runs DeepSpeed ZeRO-3, which loads the weights already "
                                        "partitioned; launch with configs/accelerate/fsdp.yaml"):
        require_pipeline(TrainerSettings(max_staleness=1), RolloutSettings(), launch(DistributedType.DEEPSPEED, 3))
    data_parallel = launch(DistributedType.MULTI_CPU)
    for runs in (data_parallel, launch(DistributedType.DEEPSPEED, 2), launch(DistributedType.FSDP)):
        require_pipeline(TrainerSettings(max_staleness=1), RolloutSettings(), runs)  # sampled on each process
    cfg = load_config("train", [f"output_dir={tmp_path}", "trainer.max_staleness=2"])
    cfg.rollout.engine = "vllm"  # the engine's availability is checked elsewhere; this check reads the settings
    with pytest.raises(UserError, match="set rollout.vllm.enable_sleep_mode=false"):
        require_pipeline(TrainerSettings(max_staleness=2), cfg.rollout, data_parallel)
    # evaluating every N steps through an engine with weights of its own would evaluate the sampler's older ones
    require_pipeline(TrainerSettings(max_staleness=1, eval_every=5), RolloutSettings(), data_parallel)  # HF: yes
    cfg.rollout.engine = "vllm_server"
    require_pipeline(TrainerSettings(max_staleness=1), cfg.rollout, data_parallel)
    with pytest.raises(UserError, match="trainer.eval_every=5 with trainer.max_staleness=1 would evaluate through "
                                        "rollout.engine=vllm_server, which holds the sampler's older weights"):
        require_pipeline(TrainerSettings(max_staleness=1, eval_every=5), cfg.rollout, data_parallel)


def test_the_viewer_shows_the_off_policy_curves_of_an_asynchronous_run_only():
    from gpg_vl.observe.viewer import curves_html

    synchronous = [{"step": s, "reward_mean": 0.5, "valid_fraction": 1.0, "alpha": 1.0, "version_lag_max": 0}
                   for s in (1, 2)]
    asynchronous = [{**m, "version_lag_mean": 1.0, "version_lag_max": 1, "is_weight_mean": 1.0, "is_weight_max": 1.2,
                     "rejected_fraction": 0.0, "behaviour_kl": 0.01, "learner_idle_s": 0.1, "sampler_idle_s": 0.2,
                     "generated_tokens_per_s": 100.0} for m in synchronous]
    assert curves_html(synchronous, [1]).count("<polyline") == 3
    page = curves_html(asynchronous, [1])
    assert page.count("<polyline") == 11 and "version lag" in page and "learner idle" in page


def test_the_held_out_accuracy_of_eval_every_is_a_curve_in_the_viewer_and_in_curves_png(tmp_path):
    from PIL import Image

    from gpg_vl.observe.report import write_curves
    from gpg_vl.observe.viewer import curves_html

    lines = [{"step": s, "reward_mean": 0.5, "valid_fraction": 1.0, "alpha": 1.0} for s in (1, 2, 3, 4)]
    evaluated = [{**m, "eval_accuracy": 0.25 * m["step"]} if m["step"] % 2 == 0 else m for m in lines]
    page = curves_html(evaluated, [1])
    assert page.count("<polyline") == 4 and "held-out accuracy" in page and "1 at step 4" in page
    assert "held-out accuracy" not in curves_html(lines, [1])
    for name, rows in (("plain", lines), ("evaluated", evaluated)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
        write_curves(tmp_path / f"{name}.jsonl", tmp_path / f"{name}.png")
    widths = [Image.open(tmp_path / f"{name}.png").size[0] for name in ("plain", "evaluated")]
    assert widths[1] > widths[0] * 1.2  # a fourth panel


@pytest.mark.slow
def test_the_readme_main_job_learns_one_step_behind(tmp_path):
    """`python scripts/train.py trainer.max_staleness=1`, the README's main job with the sampler one step behind,
    cut to its first 45 steps and 100 held-out rows (the suite's time on 2 cores): a rise of at least 0.25, the
    issue's figure, measured 0.450 -> 0.710 (one row to spare; with trainer.eval_every=5 over 50 steps: 0.590,
    0.690, then 0.700 from step 15 to 40, 0.710 at 45 and 50, so 15 steps reach 0.25 with none to spare). The
    full 150-step job's figures are in docs/results/async.md."""
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    summary = train_main(load_config("train", [f"output_dir={tmp_path}", "trainer.max_staleness=1", "seed=0",
                                               "trainer.max_steps=45", "eval.limit=100", "trainer.eval_before=false"]))
    # the same starting weights and rows as test_train.py's short run, which asserts their accuracy: 0.450
    assert round(100 * summary["accuracy_after"]) - 45 >= 25, summary  # rows, not floats: 0.70 - 0.45 < 0.25


def test_a_correction_weighs_a_stale_grpo_loss_and_leaves_its_ratio(tmp_path):
    """The house issue's measurement: algorithm=grpo one step behind (k = 1) for two steps, without a correction and
    with token_tis: step 2 trains on the same rollouts in both, and its ratio (to pi_prox, the learner's policy
    before the step: 1 on a rollout's one optimizer step) is the same, while token_tis weighs its tokens (weights
    that are not all 1). The ratio used to be exp(w log pi - log pi_b): 0.99942 against 0.99837 on the command line."""
    lines = {}
    for correction in ("none", "token_tis"):
        train_run(tmp_path / correction, "algorithm=grpo", *SMALL, "trainer.max_steps=2", "trainer.save_every=0",
                  f"trainer.correction={correction}")
        lines[correction] = _metrics(tmp_path / correction)[1]
    plain, weighed = lines["none"], lines["token_tis"]
    assert plain["version_lag_max"] == weighed["version_lag_max"] == 1
    assert plain["reward_mean"] == weighed["reward_mean"] and plain["groups_used"] == weighed["groups_used"]
    assert plain["ratio_mean"] == weighed["ratio_mean"] == 1.0 and plain["ratio_max"] == weighed["ratio_max"] == 1.0
    assert plain["is_weight_max"] == 1.0 and weighed["is_weight_max"] != 1.0 and plain["loss"] != weighed["loss"]
