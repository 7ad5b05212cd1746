"""What the model saw and said, as the trainer used it: rollouts of some steps, on disk and in the trackers.

Every `trainer.log_rollouts_every` steps (and at step 1) the trainer hands this module the step's attempts, in
the order they were sampled (the first rollout, then each resampling). For up to `trainer.log_rollouts_groups`
groups (taken in turn from each attempt, so resampled groups show too) it writes `rollouts/step-<N>.json`:
each group's prompt text and images, its G completions (boxes in the task's frame: original pixels), each
reward component and the total, the advantage, whether the group was valid (trained on), the attempt it came
from, and each completion's length and end (EOS, or cut off at the token limit). The rewards and advantages are
the attempt's own tensors, never recomputed. `scripts/view.py` turns the files into one HTML page; with
`trainer.report_to=tensorboard` or `wandb` the same groups go to that tracker as text and images.

Multi-turn rollouts (rollout.max_turns > 1): each completion also holds its trajectory turn by turn
(`trajectory_record`): each segment's text, the tool call it ended with (name, arguments, the observation's
text, error or not), the crops the model received (thumbnails, and their boxes in the original image's
pixels), the limit that ended it.

Disk use is bounded: images are JPEG thumbnails (at most `MAX_EDGE` px a side and `MAX_THUMB_BYTES` each,
`MAX_IMAGES` a prompt and `MAX_CROPS` crops a group), stored once under `rollouts/images/` by a hash of their
pixels; prompt, completion and turn texts are cut to `MAX_TEXT_CHARS` (halved until a step file fits
`MAX_STEP_BYTES`; past the smallest cut the turns are left out). A step therefore adds at most
`step_bytes_bound(groups)` bytes, whatever the model writes.

Only the main process records, from its own share of the prompts (the groups of the other processes stay there).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from gpg_vl.data.sources import load_image
from gpg_vl.data.task import prompt_text
from gpg_vl.files import write_atomic
from gpg_vl.reward.primitives import extract_answer, parse_box
from gpg_vl.rollout.types import in_task_frame

MAX_EDGE = 256  # thumbnail side, pixels
MAX_THUMB_BYTES = 64 * 1024  # one thumbnail's JPEG
MAX_IMAGES = 4  # thumbnails kept per prompt
MAX_CROPS = 8  # thumbnails of the images tools returned, kept per group (multi-turn)
MAX_TEXT_CHARS = 2000  # a prompt's or a completion's text, before a step file is squeezed further
MAX_STEP_BYTES = 1 << 20  # one step file's JSON
TOKEN_CHARS = 16  # with a teacher: one scored token shown per this many characters of a completion's text budget
GROUND_TRUTH, PREDICTED = (40, 200, 60), (230, 40, 200)  # box colours on tracker images


def step_bytes_bound(groups: int) -> int:
    """The most bytes one logged step adds to disk: its JSON plus new thumbnails."""
    return MAX_STEP_BYTES + groups * (MAX_IMAGES + MAX_CROPS) * MAX_THUMB_BYTES


def due(step: int, every: int) -> bool:
    """Whether step `step` is logged: every `every` steps and at step 1 (never with every = 0)."""
    return every > 0 and (step == 1 or step % every == 0)


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------
def thumbnail_jpeg(image: Image.Image, max_edge: int = MAX_EDGE, max_bytes: int = MAX_THUMB_BYTES) -> bytes:
    """`image` as a JPEG of at most `max_edge` px a side and `max_bytes` bytes (lower quality, then smaller)."""
    small = image.convert("RGB")
    small.thumbnail((max_edge, max_edge))
    while True:
        for quality in (85, 70, 50, 30):
            buffer = io.BytesIO()
            small.save(buffer, format="JPEG", quality=quality)
            if buffer.tell() <= max_bytes:
                return buffer.getvalue()
        small = small.resize((max(1, small.width // 2), max(1, small.height // 2)))


def store_image(image: Image.Image, folder: Path) -> str:
    """Save `image`'s thumbnail once under `folder` (named by a hash of its pixels); its name."""
    digest = hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()[:24]
    path = folder / f"{digest}.jpg"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, thumbnail_jpeg(image))
    return path.name


def message_images(messages: list[dict]) -> list[Image.Image]:
    """The PIL images of chat messages, in order (chat message format: `{"type": "image", "image": ...}`)."""
    images = []
    for message in messages:
        content = message["content"]
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image":
                value = part.get("image")
                images.append(value if isinstance(value, Image.Image) else load_image(value))
    return images


def answer_box(text: str) -> list[float] | None:
    """The box of a completion's answer, in the frame of its text (None without exactly one box)."""
    answer = extract_answer(text)
    return _box(None if answer is None else parse_box(answer))


def drawn_answer(task, text: str) -> dict:
    """What the pages draw of a completion's answer on its image, in the frame of its text: `box`, for a task with
    boxes (its own `answer_region` where it has one: GUI grounding's box answers; else `answer_box`), and `point`,
    for a task that reads clicks (`answer_point`: tasks/gui.py)."""
    drawn = {}
    if task.uses_boxes:
        region = getattr(task, "answer_region", None)
        drawn["box"] = region(text) if region is not None else answer_box(text)
    point = getattr(task, "answer_point", None)
    if point is not None:
        drawn["point"] = point(text)
    return drawn


def draw_boxes(image: Image.Image, size: Sequence[int], target: Sequence[float] | None,
               predicted: Sequence[Sequence[float] | None]) -> Image.Image:
    """A copy of `image` (a thumbnail of an original of `size` (W, H)) with the target and predicted boxes,
    given in original pixels, drawn at its scale."""
    drawn = image.convert("RGB")
    scale_x, scale_y = drawn.width / size[0], drawn.height / size[1]
    draw = ImageDraw.Draw(drawn)
    for box, colour in [(b, PREDICTED) for b in predicted] + [(target, GROUND_TRUTH)]:
        if box is not None:
            draw.rectangle((box[0] * scale_x, box[1] * scale_y, box[2] * scale_x, box[3] * scale_y),
                           outline=colour, width=2)
    return drawn


# ---------------------------------------------------------------------------------------------
# the step record
# ---------------------------------------------------------------------------------------------
def chosen_groups(attempts: Sequence, limit: int) -> list[tuple[int, int]]:
    """(attempt, group) pairs, at most `limit`: group 0 of each attempt, then group 1 of each, ..."""
    widths = [len(attempt.rows) for attempt in attempts]
    order = [(a, b) for b in range(max(widths, default=0)) for a, width in enumerate(widths) if b < width]
    return order[:limit]


def trajectory_record(trajectory, tokenizer, *, text_chars: int = MAX_TEXT_CHARS,
                      store: Callable | None = None) -> dict:
    """A trajectory turn by turn, JSON-ready: `turns`, one per model segment: its text and the tool call it
    ended with (None without one): name, arguments (JSON text), the observation's text, whether it was an error,
    and its crops: the prompt image each shows (`source`, -1 for an image the tool made), its box in that image's
    pixels, and, with `store` (image -> thumbnail name or None), its thumbnail (without `store`, an image a tool made
    is kept inline as `jpeg`, base64: it cannot be cut again from the row's image). Also which limit ended it
    (none, turn, image, token), its tool errors and its generated tokens (the model's, observations aside). A
    call that a limit stopped has no crops."""
    crops = list(zip(trajectory.crop_boxes, trajectory.images, strict=False))
    calls = {call.turn: (index, call) for index, call in enumerate(trajectory.calls)}
    turns, used = [], 0
    for k, (start, end) in enumerate(trajectory.segments):
        turn = {**_clipped(tokenizer.decode(trajectory.token_ids[start:end], skip_special_tokens=True), text_chars),
                "call": None}
        if k in calls:
            index, call = calls[k]
            shown = crops[used:used + call.images] if index < len(trajectory.observations) else []
            used += len(shown)
            turn["call"] = {"name": call.name, "arguments": _clipped(json.dumps(call.arguments), text_chars)["text"],
                            "error": bool(call.error), "text": _clipped(call.text, text_chars)["text"],
                            "crops": [{"source": int(source), "box": _box(box),
                                       "image": store(image) if store is not None else None,
                                       **({"jpeg": _inline(image)} if store is None and source < 0 else {})}
                                      for (source, box), image in shown]}
        turns.append(turn)
    return {"turns": turns, "limit": trajectory.limit, "tool_errors": int(trajectory.tool_errors),
            "generated": int(sum(trajectory.loss_mask))}


def _inline(image) -> str:
    """A small JPEG thumbnail as base64 text: an image a tool made, kept in a record that has no image folder (an
    evaluation's predictions), since it cannot be cut again from the row's image."""
    return base64.b64encode(thumbnail_jpeg(image, max_edge=160)).decode()


def _crop_store(folder: Path) -> Callable:
    """image -> its thumbnail's name under `folder`, for the first MAX_CROPS images of a group (None after)."""
    kept: list[str] = []

    def store(image) -> str | None:
        if len(kept) >= MAX_CROPS:
            return None
        kept.append(store_image(image, folder))
        return kept[-1]

    return store


def completion_records(attempt, b: int, texts: list[str], *, policy, task, text_chars: int, turns: bool,
                       image_folder: Path) -> list[dict]:
    """The G completions of group `b` of an attempt (`texts`: the attempt's completions in the task's frame)."""
    group_size = attempt.rollout.group_size
    mask = attempt.rollout.completion_mask  # [b * G, C]
    trajectories = attempt.rollout.trajectories if turns else None
    store = _crop_store(image_folder)
    completions = []
    for g in range(group_size):
        sequence = b * group_size + g
        tokens = int(mask[sequence].sum())
        ended = tokens > 0 and int(attempt.rollout.completion_ids[sequence, tokens - 1]) in policy.family.eos_ids
        text = texts[sequence]
        completions.append({
            **_clipped(text, text_chars),
            "reward": _number(attempt.rewards[b, g]),
            "components": {name: _number(values[b, g]) for name, values in attempt.components.items()},
            "advantage": _number(attempt.advantages[b, g]),
            "tokens": tokens, "end": "eos" if ended else "cut",
            **drawn_answer(task, text),
            **scored_tokens(attempt.rollout, sequence, policy.family, text_chars // TOKEN_CHARS),
            **(trajectory_record(trajectories[sequence], policy.family.tokenizer, text_chars=text_chars,
                                 store=store) if trajectories else {}),
        })
    return completions


def scored_tokens(rollout, sequence: int, family, limit: int) -> dict:
    """With a teacher (`Rollout.token_logps`): {"scored": {"tokens", "student", "teacher"}}, the first `limit` of
    the completion's counted tokens (their text, and the student's and the teacher's log-probs); else {}."""
    if getattr(rollout, "token_logps", None) is None or limit <= 0:
        return {}
    tokenizer = family.tokenizer
    counted = rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask.bool()
    columns = counted[sequence].nonzero().flatten()[:limit].tolist()
    ids = rollout.completion_ids[sequence, columns].tolist()
    return {"scored": {"tokens": [tokenizer.decode([token]) for token in ids],
                       **{key: [round(float(values[sequence, c]), 3) for c in columns]
                          for key, values in rollout.token_logps.items()}}}


def step_record(step: int, attempts: Sequence, *, policy, task, groups: int, image_folder: Path,
                text_chars: int = MAX_TEXT_CHARS, turns: bool = True) -> dict:
    """The JSON-ready record of one step's rollouts (see the module doc); thumbnails are saved in `image_folder`.
    `turns`: multi-turn completions hold their trajectories turn by turn."""
    frames: dict[int, list[str]] = {}  # attempt -> its completions in the task's frame
    records = []
    for a, b in chosen_groups(attempts, groups):
        attempt, whole = attempts[a], task
        task = whole.tasks[attempt.task] if getattr(attempt, "task", None) else whole  # task=mix: the group's own
        if a not in frames:
            frames[a] = in_task_frame(policy, task, attempt.rollout.texts, attempt.prompts, attempt.rollout.group_size)
        row = attempt.rows[b]
        messages = task.messages(row)
        images = message_images(messages)[:MAX_IMAGES]
        completions = completion_records(attempt, b, frames[a], policy=policy, task=task, text_chars=text_chars,
                                         turns=turns, image_folder=image_folder)
        prompt = _clipped(prompt_text(messages), text_chars)
        records.append({
            "attempt": a, "group": b, "id": str(row.get("id", b)), "valid": bool(attempt.valid[b]),
            "prompt": prompt["text"], "prompt_chars": prompt["chars"], "prompt_truncated": prompt["truncated"],
            "images": [store_image(image, image_folder) for image in images],
            "image_sizes": [[image.width, image.height] for image in images],
            "target": _clipped(str(task.target(row)), text_chars)["text"],
            **({"target_box": _box(row.get("box"))} if task.uses_boxes else {}),
            "completions": completions,
            **({"task": attempt.task, "reward_names": list(task.reward_functions),
                "reward_weights": {n: task.reward_weights.get(n, 1.0) for n in task.reward_functions}}
               if getattr(attempt, "task", None) else {}),
        })
        task = whole
    return {
        "step": step, "task": task.name, "uses_boxes": bool(task.uses_boxes),
        "reward_names": list(task.reward_functions),
        "reward_weights": {name: task.reward_weights.get(name, 1.0) for name in task.reward_functions},
        "attempts": len(attempts), "groups_per_attempt": [len(attempt.rows) for attempt in attempts],
        "valid_per_attempt": [int(attempt.valid.sum()) for attempt in attempts],
        "text_chars": text_chars, "turns_left_out": not turns and any(a.rollout.trajectories for a in attempts),
        "groups": records,
    }


def log_rollouts(step: int, attempts: Sequence, *, policy, task, output_dir: str | Path, every: int, groups: int,
                 accelerator=None) -> Path | None:
    """Record step `step`'s rollouts when it is due (`due`), on the main process: `rollouts/step-<N>.json`, and the
    trackers the accelerator has (tensorboard, wandb). Returns the file written, or None."""
    if not due(step, every) or groups <= 0 or (accelerator is not None and not accelerator.is_main_process):
        return None
    attempts = [attempt for attempt in attempts if attempt.rollout is not None]  # a process without prompts
    folder = Path(output_dir) / "rollouts"
    text_chars, turns = MAX_TEXT_CHARS, True
    while True:
        record = step_record(step, attempts, policy=policy, task=task, groups=groups,
                             image_folder=folder / "images", text_chars=text_chars, turns=turns)
        data = json.dumps(record, ensure_ascii=False).encode()
        if len(data) <= MAX_STEP_BYTES or (text_chars <= 16 and not turns):
            break
        if text_chars > 16:
            text_chars //= 2
        else:
            turns = False  # still too large with the shortest texts: the turns are left out
    path = folder / f"step-{step}.json"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    for tracker in getattr(accelerator, "trackers", None) or []:
        send = TRACKERS.get(tracker.name)
        if send is not None:
            send(accelerator.get_tracker(tracker.name, unwrap=True), record, folder, step)
    return path


def read_steps(output_dir: str | Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """Every readable `rollouts/step-<N>.json` of a run, by step. A damaged file (cut short, empty, not a step
    record, a step that is not a whole number) is skipped, with one warning naming it, through `warn`."""
    records = []
    for path in sorted((Path(output_dir) / "rollouts").glob("step-*.json"), key=_step_order):
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            problem = f"it is not readable JSON ({error})"
        else:
            problem = _record_problem(record)
        if problem is None:
            records.append(record)
        elif warn is not None:
            warn(f"skipped {path}: {problem}; the page shows the other steps.")
    return records


def _step_order(path: Path) -> tuple[int, str]:
    number = path.stem.split("-", 1)[1]
    return (int(number), path.name) if number.isdigit() else (-1, path.name)


def _record_problem(record) -> str | None:
    """Why `record` is not a step record the viewer can show (None when it is one)."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not a step record"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return f"its step is {step!r}, not a whole number"
    if not isinstance(record.get("groups"), list) or not all(isinstance(g, dict) for g in record["groups"]):
        return "its groups are not a list of records"
    return None


# ---------------------------------------------------------------------------------------------
# trackers: name (as accelerate calls it) -> fn(unwrapped tracker, record, rollouts folder, step)
# ---------------------------------------------------------------------------------------------
def tracker_image(group: dict, folder: Path) -> Image.Image | None:
    """A group's first thumbnail, with its target and predicted boxes drawn (grounding tasks)."""
    if not group["images"]:
        return None
    with Image.open(folder / "images" / group["images"][0]) as opened:
        image = opened.convert("RGB")
    if "target_box" not in group:
        return image
    return draw_boxes(image, group["image_sizes"][0], group["target_box"], [c["box"] for c in group["completions"]])


def group_markdown(group: dict, names: list[str]) -> str:
    """A group as markdown (tensorboard's text plugin): its prompt, a table of scores, then each completion."""
    state = "valid" if group["valid"] else "invalid (equal rewards: not trained on)"
    lines = [f"**{group['id']}**, attempt {group['attempt']}, {state}; target: `{group['target']}`", "",
             _fenced(group["prompt"]), "",
             "| # | reward | advantage | " + " | ".join(names) + " | tokens | end |",
             "|---" * (len(names) + 5) + "|"]
    for g, c in enumerate(group["completions"]):
        scores = " | ".join(_shown(c["components"][n]) for n in names)
        lines.append(f"| {g} | {_shown(c['reward'])} | {_shown(c['advantage'])} | {scores} | {c['tokens']} "
                     f"| {c['end']} |")
    for g, c in enumerate(group["completions"]):
        lines += ["", f"completion {g}:", _fenced(c["text"])]
    return "\n".join(lines)


def to_tensorboard(writer, record: dict, folder: Path, step: int) -> None:
    import numpy as np

    for i, group in enumerate(record["groups"]):
        writer.add_text(f"rollouts/group_{i}", group_markdown(group, record["reward_names"]), step)
        image = tracker_image(group, folder)
        if image is not None:
            writer.add_image(f"rollouts/group_{i}", np.asarray(image), step, dataformats="HWC")
    writer.flush()


def to_wandb(run, record: dict, folder: Path, step: int) -> None:
    """One table row per completion, the group's image (boxes drawn) in a `wandb.Image` column."""
    import wandb

    names = record["reward_names"]
    table = wandb.Table(columns=["step", "group", "id", "attempt", "valid", "image", "prompt", "target", "completion",
                                 "reward", "advantage", *names, "tokens", "end"])
    for i, group in enumerate(record["groups"]):
        image = tracker_image(group, folder)
        shown = None if image is None else wandb.Image(image)
        for c in group["completions"]:
            table.add_data(step, i, group["id"], group["attempt"], group["valid"], shown, group["prompt"],
                           group["target"], c["text"], float(c["reward"]), float(c["advantage"]),
                           *[float(c["components"][n]) for n in names], c["tokens"], c["end"])
    run.log({"rollouts": table}, step=step)


TRACKERS: dict[str, Callable] = {"tensorboard": to_tensorboard, "wandb": to_wandb}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _clipped(text: str, limit: int) -> dict:
    return {"text": text[:limit], "chars": len(text), "truncated": len(text) > limit}


def _number(value) -> float | str:
    """A float for JSON; NaN and infinities as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return number if math.isfinite(number) else str(number)


def _shown(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.3f}"


def _box(box) -> list[float] | None:
    return None if box is None else [float(v) for v in box]


def _fenced(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}\n{text}\n{fence}"
