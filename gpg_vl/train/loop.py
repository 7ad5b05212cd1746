"""The training loop, on accelerate. Read `train` top to bottom: (sample -> score -> advantage -> loss ->
optimizer steps -> log -> save) per step -> finish, on a `Run` that `setup` built once. GPG by default; the
GRPO family by trainer.loss. The step's parts are in step/ (sampling and threshold resampling in step/sample.py,
the update: micro-batches, optimizer steps, in step/update.py), building a run in setup.py, a step's record
(metrics, rollouts) in step_log.py.

Two ways in: `setup(cfg)` builds a run from a composed config (the command line: task, accelerator, the
output folder's claim, the policy with LoRA and a frozen vision tower, the reference, then all of
`setup_policy`); `setup_policy(policy, task, settings)` builds one around a policy the caller built. Then
`train(run)`.

Nothing here assumes one process: prompts of a step are split across processes, every count that
drives a decision (valid groups, resampling, the loss normalizer) is all-reduced, and checkpoints are
written by the main process only.
"""

from __future__ import annotations

import json
import time

import torch
from accelerate import Accelerator

from gpg_vl.files import write_atomic
from gpg_vl.objective import loss_alpha
from gpg_vl.observe.report import write_curves
from gpg_vl.rollout.engine import EngineUnreachable
from gpg_vl.train.checkpoint.folder import latest_checkpoint, writing
from gpg_vl.train.checkpoint.save import save_checkpoint
from gpg_vl.train.eval.held_out import evaluate_during, evaluate_held_out
from gpg_vl.train.mixed import task_step_metrics
from gpg_vl.train.run import Run, RunData, RunSettings, RunState
from gpg_vl.train.setup import bar_label, setup, setup_policy
from gpg_vl.train.step.loss_call import resolve_loss
from gpg_vl.train.step.pipeline import count_sampled, start_pipeline
from gpg_vl.train.step.sample import budget_spent
from gpg_vl.train.step.update import update
from gpg_vl.train.step_log import WALL_CLOCK_METRICS, log_step, pipeline_metrics, step_metrics, trajectory_step_metrics

# the way in (`setup` / `setup_policy`, then `train`) and what a run is made of, importable from here
__all__ = ["WALL_CLOCK_METRICS", "Run", "RunData", "RunSettings", "RunState", "bar_label", "finish", "setup",
           "setup_policy", "step", "step_metrics", "train"]


def train(run: Run) -> dict:
    """Train the run's policy on its task with trainer.loss (GPG by default); returns the run summary (also
    written to summary.json). Reads top to bottom: evaluate -> steps (sample, score, advantage, update, log,
    save) -> final save and evaluation. The output folder is released when it returns or raises."""
    with run.held:
        if run.trainer.eval_before and run.state.start_step == 0:
            evaluate_held_out(run, "before")
        run.pipeline = start_pipeline(run)  # trainer.max_staleness >= 1: a sampler thread
        try:
            for _ in range(run.state.start_step + 1, run.trainer.max_steps + 1):
                spent = budget_spent(run.trainer, run.state.counters)  # checked first: a resume past it stops too
                if spent:  # a budget of sampled completions or tokens: equal-cost comparisons of G, variants, tools
                    run.bar.close()
                    run.state.summary["ended_by"] = spent
                    run.accelerator.print(f"The run ended after step {run.state.step} of trainer.max_steps="
                                          f"{run.trainer.max_steps}: {spent}.")
                    break
                counters = dict(run.state.counters)  # a step the engine fails in is counted again on resume
                metrics = None
                try:
                    metrics = step(run)
                    learned(run, metrics)
                except EngineUnreachable as error:
                    if metrics is not None and run.state.updated:  # the update ran: its line and rollouts go
                        log_step(run, metrics, run.state.attempts)  # with its checkpoint
                    stop_on_lost_engine(run, error, counters)
                metrics.update(evaluate_during(run))  # trainer.eval_every: the held-out split, at this step
                log_step(run, metrics, run.state.attempts)
                stop_on_bad_steps(run)
                save_step(run)
                run.pipeline.released(run.state.step)  # the sampler may now sample with the weights after it
        finally:
            run.pipeline.close()
        return finish(run)


# ---------------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------------
def step(run: Run) -> dict:
    """One rollout and its update: the step's sampling stage (sample + score + advantage, resampling until enough
    groups carry signal; run.pipeline's: in this thread, or a sampler's beside it), then the optimizer steps on the
    valid groups; returns the step's metrics."""
    trainer, accelerator, state = run.trainer, run.accelerator, run.state
    state.step += 1
    state.updated = False
    started = time.perf_counter()
    pipeline, loss = run.pipeline, resolve_loss(trainer, run.learner.max_new_tokens)  # the pipeline owns its mode
    sampled = pipeline.take(state.step)
    collected = sampled.collected
    rolled = time.perf_counter()
    state.attempts = collected.attempts
    count_sampled(state.counters, sampled, trainer.group_size)  # resampling included; generated tokens only
    # loss + step, on valid groups only; a loss whose KL is on takes every group, and reports groups_used and alpha
    if collected.groups_valid > 0 or loss.kl_everywhere or run.learner.teacher is not None:
        result = update(run.learner, collected.attempts, stale=pipeline.stale, loss=loss)
        state.updated = not result.get("skipped")
        warning = pipeline.mismatch_warning(result)  # an engine with its own weights: off-policy?
        if warning:
            run.warn(warning)
    else:
        result = {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
        run.warn("a step had no group with differing rewards after trainer.max_attempts rollouts; "
                 "it was skipped (check the task's rewards, or raise rollout.temperature).")
    updated = time.perf_counter()
    _count_bad_step(run, result)
    engines = list(run.data.engines.values()) or [run.engine]  # task=mix: each task's
    turns = trajectory_step_metrics(collected, accelerator) if any(e.multiturn.multi_turn for e in engines) else {}
    valid = collected.groups_valid - int(result.get("groups_rejected", 0))  # all-rejected groups count in M
    versions = [v for a in collected.attempts if a.rollout is not None for v in a.rollout.weight_versions or []]
    return {"step": state.step, **step_metrics(collected, accelerator, run.data.reward_names),
            **turns, **({"rollout_weight_version": min(versions)} if versions else {}),
            "valid_fraction": collected.valid_fractions[0], "valid_fractions": collected.valid_fractions,
            "attempts": len(collected.valid_fractions), "groups_sampled": collected.groups_sampled,
            "groups_used": collected.groups_valid,
            "alpha": loss_alpha(trainer.age, collected.groups_sampled, valid),
            "completions_sampled": state.counters["completions_sampled"],
            "tokens_sampled": state.counters["tokens_sampled"],
            **result, "lr": run.learner.scheduler.get_last_lr()[0],
            "nonfinite_steps": state.counters["nonfinite_steps"],
            **sampled.stream, **pipeline_metrics(state.step, sampled),
            "rollout_s": sampled.rollout_s, "update_s": updated - rolled,
            "step_s": time.perf_counter() - started, **task_step_metrics(run, collected)}  # task=mix: each task's


def learned(run: Run, metrics: dict) -> None:
    """The weights after the step go to the pipeline: an engine with its own weights takes them (k = 0: a sync,
    which may find the engine gone once the step's metrics exist) or the sampler's snapshot (k >= 1); its time
    counts in the step's update_s and step_s."""
    started = time.perf_counter()
    run.pipeline.learned(run.state.step)
    took = time.perf_counter() - started
    metrics["update_s"] += took
    metrics["step_s"] += took


def _count_bad_step(run: Run, result: dict) -> None:
    """A NaN or infinite loss or gradient (or teacher advantages, all of them): update() took no optimizer step; too
    many in a row stop the run. Groups whose teacher advantages are not finite are said, step by step."""
    counters = run.state.counters
    bad_step = bool(result.get("nonfinite"))
    counters["nonfinite_steps"] += bad_step
    counters["bad_steps_in_a_row"] = counters["bad_steps_in_a_row"] + 1 if bad_step else 0
    if result.get("teacher_nonfinite_groups"):
        coefs = sorted({f"{t.settings.coef:g}" for t in run.learner.teacher.by_task.values() if t is not None})
        skipped = (f", so the step changed no weight ({counters['bad_steps_in_a_row']} in a row, trainer.max_bad_steps="
                   f"{run.trainer.max_bad_steps})") if bad_step else ""
        run.accelerator.print(f"warning: step {run.state.step}: the teacher's advantages of "
                              f"{result['teacher_nonfinite_groups']} groups are NaN or infinite (teacher.coef="
                              f"{'/'.join(coefs)} "
                              "times the log-prob gap overflows, or the teacher gave a sampled token probability 0); "
                              f"those groups were left out{skipped}.")
    elif bad_step:
        run.accelerator.print(f"warning: step {run.state.step}: the loss or gradient is NaN or infinite (loss="
                              f"{result['loss']}, grad_norm={result['grad_norm']}); the step was skipped, no weight "
                              f"changed ({counters['bad_steps_in_a_row']} in a row, trainer.max_bad_steps="
                              f"{run.trainer.max_bad_steps}).")


def stop_on_bad_steps(run: Run) -> None:
    """Too many steps in a row with a NaN or infinite loss or gradient end the run in one sentence."""
    trainer, bad = run.trainer, run.state.counters["bad_steps_in_a_row"]
    if trainer.max_bad_steps and bad >= trainer.max_bad_steps:
        last = latest_checkpoint(run.output_dir) if run.main else None
        run.stop(f"stopped at step {run.state.step}: the last {bad} steps had a NaN or infinite loss "
                 f"or gradient (trainer.max_bad_steps={trainer.max_bad_steps}) and changed no weight; the last good "
                 f"checkpoint, {last or 'none (none was written)'}, is intact: lower trainer.lr, check the task's "
                 "rewards and data, then continue with resume=auto.")


def stop_on_lost_engine(run: Run, error: EngineUnreachable, counters: dict) -> None:
    """The rollout engine or the teacher's server was lost mid-step (a vLLM server unreachable for
    rollout.vllm_server.timeout_s or teacher.timeout_s): on every process, checkpoint what is done (this step's
    update if it ran, else the step before) with what the pipeline says a resumed run needs (`lost`: synchronous,
    the step's prompts and random state as it began, so a resumed run draws and samples it again as the uninterrupted
    run does; beside the learner, the sampler's state as it began the next step, or one sentence naming the last
    checkpoint when it never began it) and stop in one sentence. A step whose update had not run is counted again
    when it is drawn again: its counters go back to `counters`, as the step began with them."""
    state = run.state
    done = state.step if state.updated else state.step - 1
    if not state.updated:  # its samples are drawn again on resume: counted then, not now (a teacher lost in the
        state.counters.update(counters)  # update after they were counted)
    state.step = done
    in_flight = run.pipeline.lost(error)
    path = run.output_dir / f"checkpoint-{done}"
    save_checkpoint(path, run.learner, run.data.stream, done, keep=run.trainer.keep_checkpoints,
                    counters=state.counters, config=run.settings.config, record=state.record, in_flight=in_flight)
    run.stop(f"{str(error).rstrip('.')}; the run stopped after step {done} and wrote {path.name}: continue with "
             "resume=auto once that server is back.")


def save_step(run: Run) -> None:
    """checkpoint-<step>/ every trainer.save_every steps (never while steps are failing, so the last good
    checkpoint is not rotated away)."""
    state = run.state
    if run.trainer.save_every and state.step % run.trainer.save_every == 0:
        if state.counters["bad_steps_in_a_row"] or not _finite_weights(run.learner.model, run.accelerator):
            run.warn(f"step {state.step}: no checkpoint written: the weights or the last step are not finite.")
        else:
            in_flight = run.pipeline.state_dict()  # first: the stream waits
            save_checkpoint(run.output_dir / f"checkpoint-{state.step}", run.learner, run.data.stream, state.step,
                            keep=run.trainer.keep_checkpoints, counters=state.counters, config=run.settings.config,
                            record=state.record, in_flight=in_flight)


def finish(run: Run) -> dict:
    """The final save and evaluation; summary.json and curves.png; returns the summary."""
    state, stream = run.state, run.data.stream
    run.bar.close()
    save_checkpoint(run.output_dir / "final", run.learner, stream, state.step, counters=state.counters,
                    config=run.settings.config, record=state.record)
    if stream.bad.bad:
        run.accelerator.print(stream.bad.report("training rows"))
    if run.trainer.eval_after:
        evaluate_held_out(run, "after")
    summary = state.summary
    summary["steps"] = state.step
    summary["train_seconds"] = state.record["train_seconds"]  # every continuation's steps, up to this one
    summary["data"] = stream.bad.summary()
    summary.update({key: value for key, value in state.counters.items() if key != "bad_steps_in_a_row"})
    if run.main:
        with writing("write summary.json", run.output_dir):
            write_atomic(run.output_dir / "summary.json", json.dumps(summary, indent=2))
        if run.metrics_file.is_file() and run.metrics_file.stat().st_size:  # a resumed run's too, with no step left
            with writing("write curves.png", run.output_dir):
                write_curves(run.metrics_file, run.output_dir / "curves.png")
    if run.trainer.report_to != "none":
        run.accelerator.end_training()
    return summary


def _finite_weights(model, accelerator: Accelerator) -> bool:
    """Whether every trainable weight is finite, on every process (one parameter at a time: little memory)."""
    bad = sum(int(not torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    return int(accelerator.reduce(torch.tensor(bad, device=accelerator.device), "sum")) == 0
