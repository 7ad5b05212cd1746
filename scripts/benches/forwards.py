"""--forwards: the update alone, on one sampled step, under configurations whose forwards per micro-batch differ: GPG
alone, GPG with a teacher, GRPO with its reference and 2 epochs, and both (a teacher and 2 epochs); each with `_apart`:
the policy's log-probs before the update scored by forwards without gradient apart from the first optimizer step's
(`Learner.share_first_forward=False`: one such forward per micro-batch, as 7175d10 ran a teacher alone or GRPO's 2
epochs; 7175d10 ran two with both)."""

from __future__ import annotations

import copy
import random
import statistics
from dataclasses import replace

import psutil
import torch

from benches.common import GpgRunner, alternate_updates, make_rows
from gpg_vl.config.schema import TeacherSettings
from gpg_vl.experiments import Meter
from gpg_vl.train.step.reference import Reference
from gpg_vl.train.teacher.build import Teachers
from gpg_vl.train.teacher.local import frozen_teacher

GRPO_2 = {"loss": "grpo", "aggregation": "seq_mean_token_mean", "clip_low": 0.2, "clip_high": None, "kl_coef": 0.04,
          "ppo_epochs": 2, "age": False}  # configs/algorithm/grpo.yaml with trainer.ppo_epochs=2
SHARED = ("gpg", "teacher", "grpo2", "teacher_grpo2")
CONFIGURATIONS = (*SHARED, *(f"{name}_apart" for name in SHARED[1:]))


def learners(runner: GpgRunner, names: list[str], seed: int) -> dict:
    """Each configuration's learner around the bench model: a teacher is the bench model moved by noise (another
    distribution, the same tokenizer), the reference a frozen copy of the initial weights."""
    base = runner.learner
    teacher_model = copy.deepcopy(runner.policy.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in teacher_model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter) * 0.05)
    teacher = Teachers({None: frozen_teacher(teacher_model, runner.policy.family, TeacherSettings(model="bench"),
                                             base.settings)})
    grpo = replace(base.settings, **GRPO_2)
    reference = copy.deepcopy(runner.policy.model).requires_grad_(False).eval()
    built = {"gpg": base, "teacher": replace(base, teacher=teacher),
             "grpo2": replace(base, settings=grpo, reference=Reference(reference)),
             "teacher_grpo2": replace(base, settings=grpo, reference=Reference(reference), teacher=teacher)}
    built.update({f"{name}_apart": replace(built[name], share_first_forward=False) for name in SHARED[1:]})
    return {name: built[name] for name in names}


def main_forwards(args) -> None:
    """Update seconds (wall and CPU) of each configuration of --forwards on one sampled step, the configurations
    alternating in a fresh order each round, at each --threads count, in this one process."""
    names = args.forwards.split(",")
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown --forwards {unknown}; known: {', '.join(CONFIGURATIONS)}")
    image_size, group_size = int(args.image_sizes.split(",")[0]), int(args.group_sizes.split(",")[0])
    runner = GpgRunner(args, make_rows(args.prompts * 2, image_size, args.seed), group_size, image_size, "default")
    attempts = runner.sample().attempts
    arms = learners(runner, names, args.seed)
    print(f"B={args.prompts} x G={group_size}, completions of {args.new_tokens} tokens; load average "
          f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    meter, order = Meter(args.device), random.Random(args.seed)
    table = []
    for threads in [int(x) for x in str(args.threads).split(",")]:
        torch.set_num_threads(threads)
        records = alternate_updates(arms, attempts, meter, order, threads=threads, rounds=args.warmup + args.steps)
        for name in arms:
            measured = records[name][args.warmup:]
            walls = [r["step_s"] for r in measured]
            table.append((threads, name, statistics.mean(walls), min(walls), max(walls),
                          statistics.mean(r["cpu_s"] for r in measured)))
    print("\n| threads | configuration | update s (mean) | min | max | CPU s |\n|---|---|---|---|---|---|")
    for threads, name, mean, low, high, cpu in table:
        print(f"| {threads} | {name} | {mean:.2f} | {low:.2f} | {high:.2f} | {cpu:.2f} |")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
