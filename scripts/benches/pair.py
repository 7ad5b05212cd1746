"""The default benchmark: gpg-vl's variants against TRL's GRPOTrainer, alternating step by step in one process."""

from __future__ import annotations

import random
import statistics

import psutil
import torch

from benches.common import GpgRunner, make_rows, state_mib, trl_trainer
from gpg_vl.experiments import Meter


# ---------------------------------------------------------------------------------------------
# one configuration, both trainers alternating
# ---------------------------------------------------------------------------------------------
def run_pair(args, group_size: int, image_size: int) -> dict:
    from transformers import PrinterCallback, TrainerCallback

    steps = args.warmup + args.steps
    rows = make_rows(args.prompts * steps * 2, image_size, args.seed)
    meter = Meter(args.device)
    runners = {f"gpg-vl[{v}]" if v != "default" else "gpg-vl": GpgRunner(args, rows, group_size, image_size, v)
               for v in args.gpg_variants}
    records: dict[str, list[dict]] = {"TRL": [], **{name: [] for name in runners}}
    order = random.Random(args.seed)

    class Alternate(TrainerCallback):
        def on_train_begin(self, *_, **__):
            meter.start()

        seen = 0

        def on_step_end(self, _args, state, *_, **__):
            trl = meter.stop()
            tokens, self.seen = state.num_input_tokens_seen - self.seen, state.num_input_tokens_seen
            trl.update(completion_tokens=args.prompts * group_size * args.new_tokens, all_tokens=int(tokens))
            records["TRL"].append(trl)
            # the gpg-vl variants in a fresh order each round: the runner going later was faster in earlier runs
            for name in order.sample(list(runners), len(runners)):
                records[name].append(runners[name].step(meter))
            index = len(records["TRL"])
            kind = "warm-up" if index <= args.warmup else "measured"
            print(f"  step {index} ({kind}): TRL {trl['step_s']:.2f} s", end="")
            for name in runners:
                r = records[name][-1]
                print(f" | {name} {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f} + update {r['update_s']:.2f})",
                      end="")
            print(flush=True)
            meter.start()

    trainer = trl_trainer(args, rows, group_size, image_size, steps, Alternate())
    trainer.remove_callback(PrinterCallback)  # its per-step log dict; the callback above prints the times
    trainer.train()
    first = next(iter(runners.values()))
    summary = {"group_size": group_size, "image_size": image_size,
               "state_mib": state_mib(first.model, first.optimizer),
               "trl_state_mib": state_mib(trainer.model, trainer.optimizer)}
    for name, rows_ in records.items():
        measured = rows_[args.warmup:]
        summary[name] = {key: statistics.mean(r[key] for r in measured) for key in measured[0]}
        summary[name]["peak_mib"] = max(r["peak_mib"] for r in measured)
        summary[name]["step_s_min"] = min(r["step_s"] for r in measured)
    gpg = records[next(iter(runners))][-1]
    summary["work"] = {"gpg_prompt_plus_completion_tokens": gpg["prompt_tokens"] + gpg["completion_tokens"],
                       "trl_prompt_plus_completion_tokens": records["TRL"][-1]["all_tokens"],
                       "groups_used": [r["groups_used"] for r in records[next(iter(runners))]]}
    return summary


def report(args, summary: dict) -> None:
    g, size = summary["group_size"], summary["image_size"]
    print(f"\nB={args.prompts} prompts x G={g}, image {size}x{size}, {args.new_tokens} new tokens (EOS ignored); "
          f"{args.warmup} warm-up + {args.steps} measured steps; means over measured steps")
    work = summary["work"]
    print(f"  same work: prompt+completion tokens per step gpg-vl {work['gpg_prompt_plus_completion_tokens']}, "
          f"TRL {work['trl_prompt_plus_completion_tokens']}; gpg-vl groups used per step {work['groups_used']} "
          f"of {args.prompts}")
    print(f"  persistent state (weights + grads + AdamW): gpg-vl {summary['state_mib']:.0f} MiB, "
          f"TRL {summary['trl_state_mib']:.0f} MiB")
    header = (f"  {'trainer':24s} {'s/step':>7s} {'min':>6s} {'rollout':>8s} {'update':>7s} {'cpu s':>6s} "
              f"{'steps/s':>8s} {'compl tok/s':>11s} {'peak MiB':>9s} {'vs TRL':>7s}")
    print(header)
    trl_rate = 1.0 / summary["TRL"]["step_s"]
    for name in ["TRL"] + [n for n in summary if n.startswith("gpg-vl")]:
        r = summary[name]
        rate = 1.0 / r["step_s"]
        rollout = f"{r['rollout_s']:8.2f}" if "rollout_s" in r else f"{'-':>8s}"
        update_ = f"{r['update_s']:7.2f}" if "update_s" in r else f"{'-':>7s}"
        print(f"  {name:24s} {r['step_s']:7.2f} {r['step_s_min']:6.2f} {rollout} {update_} {r['cpu_s']:6.2f} "
              f"{rate:8.3f} {r['completion_tokens'] * rate:11.1f} {r['peak_mib']:9.0f} {rate / trl_rate:6.2f}x")


def main_pair(args) -> None:
    """The default benchmark: every --group-sizes x --image-sizes configuration, TRL and gpg-vl alternating."""
    import transformers
    import trl

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"model {args.family}, device {args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"{args.cache} cache{'s (each trainer its own)' if args.cache == 'default' else ''}, "
          f"{psutil.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    summaries = []
    for image_size in [int(x) for x in args.image_sizes.split(",")]:
        for group_size in [int(x) for x in args.group_sizes.split(",")]:
            print(f"\n== G={group_size}, image {image_size}x{image_size}")
            summary = run_pair(args, group_size, image_size)
            report(args, summary)
            summaries.append(summary)
    print("\n| G | image | TRL s/step | gpg-vl s/step (rollout + update) | steps/s ratio | CPU-s ratio | "
          "TRL peak MiB | gpg-vl peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        trl_, gpg = s["TRL"], s["gpg-vl" if "gpg-vl" in s else next(n for n in s if n.startswith("gpg-vl"))]
        print(f"| {s['group_size']} | {s['image_size']} | {trl_['step_s']:.2f} | {gpg['step_s']:.2f} "
              f"({gpg['rollout_s']:.2f} + {gpg['update_s']:.2f}) | {trl_['step_s'] / gpg['step_s']:.2f}x | "
              f"{trl_['cpu_s'] / gpg['cpu_s']:.2f}x | "
              f"{trl_['peak_mib']:.0f} | {gpg['peak_mib']:.0f} |")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
