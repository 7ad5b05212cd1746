"""Build the embedded tiny model: a random Qwen2.5-VL, then a three-stage warm start on `shapes`.

    python scripts/build_tiny.py                      # writes gpg_vl/assets/tiny-qwen2.5-vl (~7 min, CPU)
    python scripts/build_tiny.py --out /tmp/tiny --eval-every 50

1. Vision probe (`--vision-steps`): the vision tower learns to say, for each merged image token,
   which coloured shape lies under it, through a linear probe that is then thrown away. A tiny
   language model learns to read raw random vision features very slowly; this makes them legible.
2. Supervised pass on correct demonstrations (`--steps`): the answer format, and reading the image.
3. Supervised pass on a noisy teacher (`--teacher-steps`): right `--teacher-accuracy` of the time,
   otherwise it gives a fixed guess for the question type ("red", "circle", "1", "left"). The model
   keeps what it can see, but greedy decoding now often follows the guess while sampling still finds
   the right answer: held-out greedy accuracy lands between 10% and 60%, and reinforcement learning
   with a verifiable reward has real probability mass to raise.

Everything is seeded and runs on CPU with deterministic algorithms, so the same command writes the
same weights (the last line prints their hash).

    python scripts/build_tiny.py --zoom               # writes gpg_vl/assets/tiny-qwen2.5-vl-zoom (~15 min, CPU)

`--zoom` builds the cold-start model of the `zoom` task (thinking with images) from the embedded model
(or `--from-model`): a supervised pass on synthetic trajectories, teacher-forced through the HF engine's own
multi-turn path (so each observation is exactly what a rollout shows) with the loss on the model's tokens only.
A share `--zoom-tool-share` of the demonstrations zooms on the named cell, then answers from the crop; the
others answer at once (the right colour, which the full view hardly shows, so the model learns little more than
the prior). The model then calls the tool some of the time when sampled and not at all when greedy: the
reinforcement learning run has that share to raise. The shipped model is the snapshot at step 400 of

    python scripts/build_tiny.py --zoom --out /tmp/zc/b --zoom-steps 500 --batch-size 8 --zoom-tool-share 0.4 \
        --zoom-eval-rows 32 --eval-every 100          # snapshots /tmp/zc/b-step100 ... b-step500 (about 20 min)

(docs/results/zoom.md: why 400 rather than 500).

    python scripts/build_tiny.py --code               # writes gpg_vl/assets/tiny-qwen2.5-vl-code

`--code` builds the cold-start model of the `measure` task (code as a tool) the same way: a share of the
demonstrations runs the task's code in a fenced block (`<code> ```python ... ``` </code>`: the colours sorted by
area, the answer's printed), answered by the python tool in its sandbox, then answers with the printed colour's
name; the others answer at once. The shipped model is the snapshot at step 100 of

    python scripts/build_tiny.py --code --out /tmp/h61cs/c --zoom-steps 300 --batch-size 8 --zoom-tool-share 0.4 \
        --zoom-eval-rows 32 --eval-every 100          # stopped after /tmp/h61cs/c-step100 (docs/results/code.md)

    python scripts/build_tiny.py --gui                # writes gpg_vl/assets/tiny-qwen2.5-vl-gui (CPU)

`--gui` builds the warm start of the `gui` task (GUI grounding: click the element an instruction names) from the
embedded model (or `--from-model`), in two stages (docs/results/gui.md): a probe on the language model's last hidden
state at every image token teaches the model where each token is (its column and row; rotary positions are
relative, and without this the tiny model never learnt to write a token's pixels), then a supervised pass on click
demonstrations, `<think> the element </think><answer>(x, y)</answer>` in the model's frame (the named element's
centre, or another element's for a share `1 - --gui-right-share`), through the same scoring path as training.
`--gui-elements`, `--gui-instruction-first`, `--gui-target-weight` and `--gui-probe-layer` are the second attempt's
changes (docs/results/gui.md, none made the click follow the screen); their defaults build the shipped warm start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch
from gpg_vl_tasks.measure import CODE as MEASURE_CODE
from gpg_vl_tasks.shapes import COLORS, INSTRUCTION, SHAPES
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.data.task import get_task
from gpg_vl.models import scoring
from gpg_vl.models.load import load_policy
from gpg_vl.models.tiny import build_tiny
from gpg_vl.rollout.engine import EnginePrompts, Sampling, build_engine
from gpg_vl.rollout.multiturn.decoding import generate_trajectories
from gpg_vl.rollout.multiturn.tools import ToolContext, answer_call, read_call
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings, Trajectory, pad_trajectories
from gpg_vl.rollout.settings import PythonToolSettings
from gpg_vl.rollout.types import in_task_frame
from gpg_vl.train.eval.evaluate import Decoding, evaluate

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "gpg_vl" / "assets" / "tiny-qwen2.5-vl"
ZOOM_OUT = DEFAULT_OUT.with_name("tiny-qwen2.5-vl-zoom")
CODE_OUT = DEFAULT_OUT.with_name("tiny-qwen2.5-vl-code")
ZOOM_SEGMENT_TOKENS = 100  # a zoom_in call is about 80 tokens of the tiny byte-level BPE
CODE_SEGMENT_TOKENS = 100  # a measure demonstration's code block is 68 tokens
# the demonstrations' and reports' multi-turn settings: two segments; a python tool as configs/task/measure.yaml has
# it, with time to spare for an interpreter's start on a loaded machine
DEMO_SETTINGS = MultiTurnSettings(max_turns=2, tool_seconds=60.0,
                                  tools={"python": PythonToolSettings(seconds=30.0, packages="PIL", pool=4)})
ZOOM_MAX_PIXELS = 112 * 112  # the zoom experiment's model.max_pixels (configs/experiment/zoom-tiny.yaml)


def tokenizer_corpus(task) -> list[str]:
    rows = task.load("train")[:2000]
    boilerplate = "system\nYou are a helpful assistant.\nuser\nassistant\n"
    return [boilerplate] * 50 + [r["question"] + INSTRUCTION for r in rows] + [r["solution"] for r in rows]


def lazy_teacher(row: dict, accuracy: float, rng: random.Random) -> str:
    """The demonstration of a noisy teacher: right with probability `accuracy`, otherwise it gives
    the first answer of the question's type (a fixed guess), in the same format."""
    guess = FIXED_GUESS[row["question_type"]]
    if rng.random() < accuracy or guess == row["answer"]:
        return row["solution"]
    return row["solution"].replace(f" {row['answer']} ", f" {guess} ")


def sft_batch(processor, task, rows, solutions):
    """Prompt + reference completion; labels only on the completion (and its <|im_end|>)."""
    prompts = [processor.apply_chat_template(task.messages(r), tokenize=False, add_generation_prompt=True)
               for r in rows]
    texts = [p + solution + "<|im_end|>" for p, solution in zip(prompts, solutions, strict=True)]
    processor.tokenizer.padding_side = "right"
    batch = processor(text=texts, images=[r["image"] for r in rows], padding=True, return_tensors="pt")
    prompt_lengths = [len(processor(text=[p], images=[r["image"]])["input_ids"][0])
                      for p, r in zip(prompts, rows, strict=True)]
    labels = batch["input_ids"].clone()
    for i, length in enumerate(prompt_lengths):
        labels[i, :length] = -100
    labels[batch["attention_mask"] == 0] = -100
    return batch, labels


FIXED_GUESS = {"color": "red", "shape": "circle", "count": "1", "relation": "left"}
CELL_CLASSES = [f"{c} {s}" for c in COLORS for s in SHAPES] + ["empty"]


def cell_labels(row: dict, grid: int, cell: int) -> list[int]:
    """For each merged image token (row-major), the object whose box holds the cell's centre, or empty."""
    labels = []
    for gy in range(grid):
        for gx in range(grid):
            cx, cy = gx * cell + cell / 2, gy * cell + cell / 2
            label = len(CELL_CLASSES) - 1
            for obj in row["objects"]:
                if abs(cx - obj["x"]) <= obj["r"] and abs(cy - obj["y"]) <= obj["r"]:
                    label = CELL_CLASSES.index(f"{obj['color']} {obj['shape']}")
            labels.append(label)
    return labels


def pretrain_vision(model, processor, rows_at, steps: int, batch_size: int, lr: float) -> None:
    """Teach the vision tower to make each image token say what lies under it (a linear probe per token).

    A tiny language model learns to read raw random vision features very slowly; with features that
    already separate colour and shape per token, the supervised pass only has to learn where to look.
    """
    visual = model.model.visual
    probe = torch.nn.Linear(model.config.text_config.hidden_size, len(CELL_CLASSES))
    optimizer = torch.optim.AdamW(list(visual.parameters()) + list(probe.parameters()), lr=lr)
    for step in range(steps):
        rows = rows_at(step, batch_size)
        inputs = processor.image_processor(images=[r["image"] for r in rows], return_tensors="pt")
        grid = inputs["image_grid_thw"]
        features = model.model.get_image_features(inputs["pixel_values"], grid, return_dict=True).pooler_output
        side = int(grid[0, 1]) // 2
        labels = torch.tensor([label for r in rows for label in cell_labels(r, side, r["image"].width // side)])
        loss = torch.nn.functional.cross_entropy(probe(torch.cat(list(features))), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            print(f"vision step {step:4d}  probe loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def greedy_accuracy(model, processor, task, rows, batch_size=50, sample=False) -> dict[str, float]:
    processor.tokenizer.padding_side = "left"
    completions = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [processor.apply_chat_template(task.messages(r), tokenize=False, add_generation_prompt=True)
                   for r in chunk]
        inputs = processor(text=prompts, images=[r["image"] for r in chunk], padding=True, return_tensors="pt")
        out = model.generate(**inputs, do_sample=sample, max_new_tokens=32,
                             **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}))
        completions += processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return task.metrics(rows, completions)


def supervised(model, processor, task, rows_at, *, steps: int, lr: float, first_step: int, batch_size: int,
               teacher_accuracy: float, seed: int, eval_rows, eval_every: int, out: Path, label: str) -> None:
    """Cross-entropy on (possibly noisy) demonstrations, with a short linear warm-up."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    teacher_rng = random.Random(seed)
    start = time.time()
    for step in range(steps):
        model.train()
        rows = rows_at(first_step + step, batch_size)
        solutions = [lazy_teacher(r, teacher_accuracy, teacher_rng) for r in rows]
        batch, labels = sft_batch(processor, task, rows, solutions)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            print(f"{label} step {step:4d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
        if eval_every and (step + 1) % eval_every == 0:
            model.eval()
            for mode in ("greedy", "sampled"):
                metrics = greedy_accuracy(model, processor, task, eval_rows, sample=mode == "sampled")
                print(f"{label} step {step + 1} {mode}: " + json.dumps({k: round(v, 3) for k, v in metrics.items()}),
                      flush=True)
            snapshot = out.with_name(f"{out.name}-{label}{step + 1}")
            model.save_pretrained(snapshot)
            processor.save_pretrained(snapshot)


def zoom_call(family, box_model_frame) -> str:
    """The Hermes call of `zoom_in` on a box in the model's frame, as a demonstration writes it."""
    box = json.dumps([round(v) for v in box_model_frame])
    return '<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": ' + box + '}}</tool_call>'


def code_call(row: dict) -> str:
    """The fenced python call of a `measure` demonstration: the colours sorted by area, then the answer's printed."""
    return f"<code>\n```python\n{MEASURE_CODE[row['kind']]}\n```\n</code>"


def tool_demonstration(family, row: dict, size, call: str | None, tool: str) -> Trajectory:
    """A demonstration trajectory, built as the HF engine builds a rollout's (the call read and answered by the
    tool, its observation encoded by the family): the segment `call` then the answer, or the answer alone."""
    trajectory = Trajectory()
    if call is not None:
        trajectory.add_segment(family.tokenizer(call, add_special_tokens=False)["input_ids"])
        context = ToolContext.for_prompt([row["image"]], [size], family, DEMO_SETTINGS)
        result = answer_call(read_call(family, call, (tool,)), context, allowed=(tool,))
        context.close()
        if result.error:
            raise RuntimeError(f"a {tool} demonstration's call was refused: {result.text}")
        ids, inputs = family.encode_observation(result.text, result.images)
        trajectory.add_observation(ids, [view.image for view in result.views], inputs)
    answer = family.tokenizer(f"<answer> {row['answer']} </answer>", add_special_tokens=False)["input_ids"]
    trajectory.add_segment(answer + [family.eos_ids[0]])
    return trajectory


def zoom_demonstration(family, row: dict, size, use_tool: bool) -> Trajectory:
    """A zoom demonstration: a zoom on the named cell then the answer, or the answer."""
    call = zoom_call(family, family.to_model_frame(row["cell"], size)) if use_tool else None
    return tool_demonstration(family, row, size, call, "zoom_in")


COLD_STARTS = {  # --zoom / --code: the task, its tool, a demonstration's call, the segment length
    "zoom": ("zoom", "zoom_in", lambda family, row, size: zoom_call(family, family.to_model_frame(row["cell"], size)),
             ZOOM_SEGMENT_TOKENS),
    "code": ("measure", "python", lambda family, row, size: code_call(row), CODE_SEGMENT_TOKENS),
}


def tool_rollout(policy, task, rows, *, sampling: Sampling, group_size: int = 1) -> list[str]:
    """Sampled (or greedy) trajectories of `rows` through the HF engine's multi-turn path (up to 2 turns), as the
    task scores them (the calls' boxes in original pixels)."""
    messages = [task.messages(r) for r in rows]
    prompts = EnginePrompts(policy.family.encode(messages), messages)
    rollout = generate_trajectories(policy, prompts, group_size=group_size, sampling=sampling,
                                    settings=DEMO_SETTINGS, tools=task.tools)
    return in_task_frame(policy, task, rollout.texts, prompts.batch, group_size)


def tool_metrics(policy, task, rows, *, sample: bool, samples: int = 1, batch_size: int = 25,
                 segment_tokens: int = ZOOM_SEGMENT_TOKENS) -> dict[str, float]:
    """The task's metrics (accuracy, tool-call rate, ...) of greedy trajectories, or of `samples` sampled ones per
    row, on `rows`."""
    texts, group_size = [], samples if sample else 1
    sampling = Sampling(max_new_tokens=segment_tokens, greedy=not sample, temperature=1.0)
    for start in range(0, len(rows), batch_size):
        texts += tool_rollout(policy, task, rows[start:start + batch_size], sampling=sampling, group_size=group_size)
    return task.metrics([row for row in rows for _ in range(group_size)], texts)


def trajectory_sft(policy, task, rows_at, demonstrate, *, steps: int, lr: float, batch_size: int, label: str,
                   report, eval_every: int, out: Path) -> None:
    """Cross-entropy on demonstration trajectories, the loss on the model's tokens only (token mean):
    `demonstrate(rows, batch) -> trajectories` for each step's rows (`batch`: their encoded prompts); every
    `eval_every` steps `report(mode)` (mode "greedy" or "sampled") is printed and a snapshot saved."""
    family, model = policy.family, policy.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    path = scoring.choose_scoring_path(family, model, share_prompt=False, share_vision=True)
    start = time.time()
    for step in range(steps):
        rows = rows_at(step, batch_size)
        batch, trajectories = demonstrate(rows)
        ids, attention, loss_mask = pad_trajectories(trajectories, family.pad_id)
        model.train()
        logps = scoring.token_logps(family, model, batch, list(range(len(rows))), ids, attention, path=path,
                                    observations=trajectories)  # [N, C]
        loss = -torch.where(loss_mask > 0, logps, 0.0).sum() / loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        if step % 10 == 0:
            print(f"{label} step {step:4d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
        if eval_every and (step + 1) % eval_every == 0:
            for mode in ("greedy", "sampled"):
                metrics = report(mode)
                print(f"{label} step {step + 1} {mode}: " + json.dumps({k: round(v, 3) for k, v in metrics.items()}),
                      flush=True)
            snapshot = out.with_name(f"{out.name}-step{step + 1}")
            model.save_pretrained(snapshot)
            policy.processor.save_pretrained(snapshot)


def tool_sft(policy, task, rows_at, *, kind: str, steps: int, lr: float, batch_size: int, tool_share: float,
             seed: int, eval_rows, eval_every: int, out: Path) -> None:
    """`trajectory_sft` on `kind`'s demonstrations (COLD_STARTS: zoom or code): a share `tool_share` calls the tool,
    then answers; the others answer at once."""
    family, rng = policy.family, random.Random(seed)
    _, tool, make_call, segment_tokens = COLD_STARTS[kind]

    def demonstrate(rows):
        tools = [rng.random() < tool_share for _ in rows]
        batch = family.encode([task.messages(r) for r in rows])
        return batch, [tool_demonstration(family, row, batch.image_sizes[i][0],
                                          make_call(family, row, batch.image_sizes[i][0]) if use else None, tool)
                       for i, (row, use) in enumerate(zip(rows, tools, strict=True))]

    trajectory_sft(policy, task, rows_at, demonstrate, steps=steps, lr=lr, batch_size=batch_size, label=kind,
                   report=lambda mode: tool_metrics(policy, task, eval_rows, sample=mode == "sampled",
                                                    segment_tokens=segment_tokens),
                   eval_every=eval_every, out=out)


def build_cold_start(args, kind: str) -> None:
    """The cold-start model of the `zoom` task (--zoom) or the `measure` task (--code): see the module's docstring."""
    task_name, _, _, segment_tokens = COLD_STARTS[kind]
    task = get_task(task_name)
    source = str(args.from_model) if args.from_model else "embedded:tiny-qwen2.5-vl"
    policy = load_policy(source, dtype="float32", min_pixels=56 * 56, max_pixels=ZOOM_MAX_PIXELS)
    train, test = task.load("train"), task.load("test")[:args.zoom_eval_rows]

    def rows_at(step, size):
        return [train[(step * size + i) % len(train)] for i in range(size)]

    started = time.time()
    tool_sft(policy, task, rows_at, kind=kind, steps=args.zoom_steps, lr=args.zoom_lr, batch_size=args.batch_size,
             tool_share=args.zoom_tool_share, seed=args.seed, eval_rows=test, eval_every=args.eval_every,
             out=args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(args.out)
    policy.processor.save_pretrained(args.out)
    report = {mode: tool_metrics(policy, task, test, sample=mode == "sampled", samples=args.zoom_samples,
                                 segment_tokens=segment_tokens) for mode in ("greedy", "sampled")}
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()[:16]
    print(json.dumps({"held_out": {mode: {k: round(v, 3) for k, v in m.items()} for mode, m in report.items()},
                      "sha256": digest, "seconds": round(time.time() - started, 1)}))


GUI_OUT = DEFAULT_OUT.with_name("tiny-qwen2.5-vl-gui")
GUI_MAX_PIXELS = 224 * 168  # the gui experiment's model.max_pixels (configs/experiment/gui-tiny.yaml)
GUI_TOKENS = 64  # a demonstration is about 40 tokens of the tiny tokenizer


def gui_token_labels(row: dict, columns: int, rows: int) -> list[tuple[int, int, int]]:
    """For each merged image token of a `columns` x `rows` grid (row-major): its column, its row, the colour of the
    element under its centre (len(COLORS): none) and whether that is the named element (1) or not (0)."""
    width, height = row["image_size"]
    labels = []
    for j in range(rows):
        for i in range(columns):
            x, y = (i + 0.5) * width / columns, (j + 0.5) * height / rows
            under = [e["color"] for e in row["elements"]
                     if e["bbox"][0] <= x <= e["bbox"][2] and e["bbox"][1] <= y <= e["bbox"][3]]
            named = row["box"][0] <= x <= row["box"][2] and row["box"][1] <= y <= row["box"][3]
            labels.append((i, j, list(COLORS).index(under[0]) if under else len(COLORS), int(named)))
    return labels


def gui_target_cell(row: dict, columns: int, rows: int) -> tuple[int, int]:
    """The column and row of the merged image token under the named element's centre."""
    (x1, y1, x2, y2), (width, height) = row["box"], row["image_size"]
    return min(int((x1 + x2) / 2 * columns / width), columns - 1), min(int((y1 + y2) / 2 * rows / height), rows - 1)


def gui_probe(policy, task, rows_at, *, steps: int, lr: float, batch_size: int, target_weight: float = 0.0,
              mark_named: bool = False, layer: int = -1) -> None:
    """Teach the model where each image token is: a linear probe on the language model's last hidden state at every
    image token predicts the token's column, its row and the colour under it, and the whole model learns with it
    (the probe is then thrown away). Rotary positions are relative, so a tiny model that must write a token's
    pixels first needs its absolute place in its states; this stage puts it there in about 100 steps.
    `target_weight` > 0 adds a second probe, on the last prompt token's state (where the answer starts): the column
    and row of the token under the element the instruction names. The image comes before the instruction, so no
    image token can know which element is named; the answer must fetch the named element's place, and this probe
    teaches that lookup with a direct signal instead of through the digits of a click. `mark_named` (the
    instruction before the screenshot, so image tokens can read it): each image token also learns whether it lies
    in the named element. `layer`: the hidden state the probes read (-1 the last layer's output; an earlier one
    leaves the layers above it to read the place through attention, which no attention does with the last one)."""
    family, model = policy.family, policy.model
    row = rows_at(0, 1)[0]
    grid = family.encode([task.messages(row)]).inputs["image_grid_thw"][0]  # [t, h, w] patches
    rows, columns = int(grid[1]) // 2, int(grid[2]) // 2
    named = 2 if mark_named else 0  # classes of the named-element head
    probe = torch.nn.Linear(model.config.text_config.hidden_size, columns + rows + len(COLORS) + 1 + named)
    target_probe = torch.nn.Linear(model.config.text_config.hidden_size, columns + rows) if target_weight else None
    parameters = list(model.parameters()) + list(probe.parameters())
    parameters += list(target_probe.parameters()) if target_probe is not None else []
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    start = time.time()
    for step in range(steps):
        chunk = rows_at(step, batch_size)
        inputs = family.encode([task.messages(r) for r in chunk]).inputs  # left-padded: the prompts end at -1
        model.train()
        states = model(**inputs, output_hidden_states=True).hidden_states[layer]  # [N, L, D]
        logits = probe(states[inputs["input_ids"] == model.config.image_token_id])  # [N * rows * columns, K]
        labels = torch.tensor([label for r in chunk for label in gui_token_labels(r, columns, rows)])
        parts = ((0, columns), (columns, columns + rows), (columns + rows, logits.shape[1] - named))
        parts += ((logits.shape[1] - named, logits.shape[1]),) if mark_named else ()
        loss = sum(torch.nn.functional.cross_entropy(logits[:, a:b], labels[:, k]) for k, (a, b) in enumerate(parts))
        if target_probe is not None:
            target_logits = target_probe(states[:, -1])  # [N, columns + rows]
            targets = torch.tensor([gui_target_cell(r, columns, rows) for r in chunk])  # [N, 2]
            loss = loss + target_weight * (
                torch.nn.functional.cross_entropy(target_logits[:, :columns], targets[:, 0])
                + torch.nn.functional.cross_entropy(target_logits[:, columns:], targets[:, 1]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        if step % 20 == 0:
            right = [round(float((logits[:, a:b].argmax(-1) == labels[:, k]).float().mean()), 2)
                     for k, (a, b) in enumerate(parts)]
            if target_probe is not None:
                right += [round(float((target_logits[:, a:b].argmax(-1) == targets[:, k]).float().mean()), 2)
                          for k, (a, b) in enumerate(((0, columns), (columns, columns + rows)))]
            shown = "column, row, colour" + (", named" if mark_named else "") + (
                "; target column, row" if target_probe is not None else "")
            print(f"gui probe step {step:4d}  loss {loss.item():.3f}  right ({shown}) {right}  "
                  f"{time.time() - start:.0f}s", flush=True)


def gui_demonstration(family, row: dict, size, right: bool, rng: random.Random) -> Trajectory:
    """`<think> the element </think><answer>(x, y)</answer>` in the model's frame: the named element's centre, or
    (`right` false) another element's, as a teacher that confuses the elements would click."""
    others = [e["bbox"] for e in row["elements"] if tuple(e["bbox"]) != tuple(row["box"])]
    box = row["box"] if right or not others else rng.choice(others)
    x1, y1, x2, y2 = family.to_model_frame(box, size)
    named = row["instruction"].removeprefix("Click ").rstrip(".")
    text = f"<think> {named} </think><answer>({round((x1 + x2) / 2)}, {round((y1 + y2) / 2)})</answer>"
    trajectory = Trajectory()
    trajectory.add_segment(family.tokenizer(text, add_special_tokens=False)["input_ids"] + [family.eos_ids[0]])
    return trajectory


def gui_metrics(policy, task, rows, *, sample: bool, samples: int = 4) -> dict[str, float]:
    """The gui task's metrics of greedy answers, or of `samples` sampled ones per row (temperature 1)."""
    engine = build_engine(RolloutSettings(max_new_tokens=GUI_TOKENS), policy)
    decoding = Decoding(samples=samples, temperature=1.0) if sample else Decoding()
    metrics, _ = evaluate(policy, task, rows, engine=engine, batch_size=32, max_new_tokens=GUI_TOKENS,
                          decoding=decoding)
    return {k: v for k, v in metrics.items() if k in ("accuracy", "wrong_format", "pass@4", "reward/format")}


def build_gui(args) -> None:
    """The warm start of the `gui` task (see the module's docstring)."""
    task = get_task("gui", elements=args.gui_elements, instruction_first=args.gui_instruction_first)
    source = str(args.from_model) if args.from_model else "embedded:tiny-qwen2.5-vl"
    policy = load_policy(source, dtype="float32", min_pixels=56 * 56, max_pixels=GUI_MAX_PIXELS)
    train, test = task.load("train"), task.load("test")[:args.gui_eval_rows]

    def rows_at(step, size):
        return [train[(step * size + i) % len(train)] for i in range(size)]

    started, rng = time.time(), random.Random(args.seed)
    gui_probe(policy, task, rows_at, steps=args.gui_probe_steps, lr=args.gui_lr, batch_size=args.batch_size,
              target_weight=args.gui_target_weight, mark_named=args.gui_instruction_first, layer=args.gui_probe_layer)

    def demonstrate(rows):
        batch = policy.family.encode([task.messages(r) for r in rows])
        rights = [rng.random() < args.gui_right_share for _ in rows]
        return batch, [gui_demonstration(policy.family, row, batch.image_sizes[i][0], right, rng)
                       for i, (row, right) in enumerate(zip(rows, rights, strict=True))]

    def later(step, size):  # fresh rows after the probe's
        return rows_at(args.gui_probe_steps + step, size)

    trajectory_sft(policy, task, later, demonstrate, steps=args.gui_steps, lr=args.gui_lr, batch_size=args.batch_size,
                   label="gui", report=lambda mode: gui_metrics(policy, task, test, sample=mode == "sampled"),
                   eval_every=args.eval_every, out=args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(args.out)
    policy.processor.save_pretrained(args.out)
    report = {mode: gui_metrics(policy, task, test, sample=mode == "sampled") for mode in ("greedy", "sampled")}
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()[:16]
    print(json.dumps({"held_out": {mode: {k: round(v, 3) for k, v in m.items()} for mode, m in report.items()},
                      "sha256": digest, "seconds": round(time.time() - started, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="32 (8 with --zoom)")
    parser.add_argument("--vision-steps", type=int, default=200, help="per-token probe pretraining of the vision tower")
    parser.add_argument("--steps", type=int, default=400, help="supervised steps on correct demonstrations")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--teacher-steps", type=int, default=150, help="supervised steps on the noisy teacher")
    parser.add_argument("--teacher-lr", type=float, default=3e-4)
    parser.add_argument("--teacher-accuracy", type=float, default=0.4,
                        help="how often the noisy teacher's answer is right (else it gives a fixed guess)")
    parser.add_argument("--from-model", type=Path, default=None,
                        help="skip the first two stages: start the noisy-teacher pass from this model")
    parser.add_argument("--eval-every", type=int, default=0, help="print held-out accuracy every N steps")
    parser.add_argument("--zoom", action="store_true",
                        help="build the zoom task's cold-start model (default --out: assets/tiny-qwen2.5-vl-zoom)")
    parser.add_argument("--code", action="store_true",
                        help="build the measure task's cold-start model (python tool; default --out: "
                             "assets/tiny-qwen2.5-vl-code); the --zoom-* options apply to it too")
    parser.add_argument("--zoom-steps", type=int, default=400, help="supervised steps on zoom demonstrations")
    parser.add_argument("--zoom-lr", type=float, default=1e-3)
    parser.add_argument("--zoom-tool-share", type=float, default=0.4,
                        help="share of the zoom demonstrations that call zoom_in (the others answer at once)")
    parser.add_argument("--zoom-eval-rows", type=int, default=100, help="held-out rows of the zoom report")
    parser.add_argument("--zoom-samples", type=int, default=4,
                        help="sampled trajectories per held-out row in the final zoom report (--zoom-steps 0 "
                             "--from-model M: the report of M alone)")
    parser.add_argument("--gui", action="store_true",
                        help="build the gui task's warm start (default --out: assets/tiny-qwen2.5-vl-gui)")
    parser.add_argument("--gui-probe-steps", type=int, default=100, help="steps of the image-token position probe")
    parser.add_argument("--gui-steps", type=int, default=400, help="supervised steps on click demonstrations")
    parser.add_argument("--gui-lr", type=float, default=1e-3)
    parser.add_argument("--gui-right-share", type=float, default=1.0,
                        help="share of the demonstrations that click the named element (the others another one)")
    parser.add_argument("--gui-elements", type=int, default=4,
                        help="elements per synthetic screen (the experiment's task.options.elements)")
    parser.add_argument("--gui-instruction-first", action="store_true",
                        help="the question before the screenshot (the experiment's task.options.instruction_first)")
    parser.add_argument("--gui-target-weight", type=float, default=0.0,
                        help="weight of the probe on the last prompt token that names the target's column and row")
    parser.add_argument("--gui-probe-layer", type=int, default=-1,
                        help="hidden state the probes read (hidden_states index: 0 the embeddings, -1 the last layer)")
    parser.add_argument("--gui-eval-rows", type=int, default=64, help="held-out rows of the gui report")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    if args.batch_size is None:
        args.batch_size = 8 if args.zoom or args.code or args.gui else 32
    if args.gui:
        args.out = GUI_OUT if args.out == DEFAULT_OUT else args.out
        build_gui(args)
        return
    if args.zoom or args.code:
        kind = "zoom" if args.zoom else "code"
        args.out = {"zoom": ZOOM_OUT, "code": CODE_OUT}[kind] if args.out == DEFAULT_OUT else args.out
        build_cold_start(args, kind)
        return
    task = get_task("shapes")
    started = time.time()
    if args.from_model is None:
        build_tiny(args.out, tokenizer_corpus(task), seed=args.seed)
    source = args.from_model or args.out
    processor = AutoProcessor.from_pretrained(source)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
    train, test = task.load("train"), task.load("test")[:200]

    def rows_at(step, size):
        return [train[(step * size + i) % len(train)] for i in range(size)]

    common = dict(batch_size=args.batch_size, seed=args.seed, eval_rows=test, eval_every=args.eval_every,
                  out=args.out)
    if args.from_model is None:
        pretrain_vision(model, processor, rows_at, args.vision_steps, args.batch_size, 1e-3)
        supervised(model, processor, task, rows_at, steps=args.steps, lr=args.lr, first_step=args.vision_steps,
                   teacher_accuracy=1.0, label="clean", **common)
    supervised(model, processor, task, rows_at, steps=args.teacher_steps, lr=args.teacher_lr,
               first_step=args.vision_steps + args.steps, teacher_accuracy=args.teacher_accuracy, label="teacher",
               **common)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    processor.save_pretrained(args.out)
    report = {mode: greedy_accuracy(model, processor, task, test, sample=mode == "sampled")["accuracy"]
              for mode in ("greedy", "sampled")}
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()[:16]
    print(json.dumps({"held_out_accuracy": report, "sha256": digest, "seconds": round(time.time() - started, 1)}))


if __name__ == "__main__":
    main()
