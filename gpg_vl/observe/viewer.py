"""Static HTML pages to look at what the model does: a training run's rollouts, and an evaluation's predictions.

Each page is ONE self-contained file: CSS and JS inline (gpg_vl/assets/viewer/), images inline as data URIs,
curves as inline SVG; no server, no network. Every text on it (prompts, completions: untrusted model output) is
HTML-escaped here, in Python; the page's script only shows, hides and highlights what is already there, so the
page also reads with scripts off.

- `write_rollouts_html(output_dir)`: `rollouts.html` from `metrics.jsonl` (reward, valid fraction, alpha curves)
  and `rollouts/step-<N>.json` (gpg_vl/observe/rollout_log.py): a step selector, and for each recorded group its image
  and its G completions side by side, coloured by advantage, with their reward components; for grounding tasks
  the predicted and target boxes drawn on the image in original pixels.
- `write_predictions_html(path, task, records, rows, metrics)`: `predictions.html` beside `predictions.jsonl`: a
  right/wrong filter, accuracy broken down by the task's `group_columns`, and for grounding tasks the predicted
  and target boxes, and the segmenter's mask over the ground-truth mask when a segmenter ran. With k samples per
  row (eval.samples) it shows the first SAMPLES_SHOWN of each row and says how many it hides (the counts and
  tables cover them all; predictions.jsonl holds them), so the page stays small whatever k is.

Multi-turn completions (rollout.max_turns > 1) show turn by turn on both pages: each segment's text, the tool
call it ended with (name, arguments), the observation's text, the crop the model received (thumbnail) and that
crop's box drawn on the original image (labelled `completion.turn`; hovering a turn highlights its box), the
limit that ended the trajectory.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from gpg_vl.errors import UserError
from gpg_vl.observe.rollout_log import answer_box, drawn_answer, message_images, read_steps, thumbnail_jpeg
from gpg_vl.reward.primitives import box_iou

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "viewer"
CURVES = (("reward_mean", "mean reward"), ("valid_fraction", "valid fraction (first rollout)"),
          ("alpha", "alpha = B / (B - M)"))
# an asynchronous run's (trainer.max_staleness >= 1) or a corrected one's: shown when its metrics hold them
OFF_POLICY_CURVES = (("version_lag_mean", "version lag (steps)"), ("is_weight_mean", "IS weight mean"),
                     ("is_weight_max", "IS weight max"), ("rejected_fraction", "rejected fraction"),
                     ("behaviour_kl", "KL(pi_theta, pi_behaviour), k3"), ("learner_idle_s", "learner idle (s)"),
                     ("sampler_idle_s", "sampler idle (s)"), ("generated_tokens_per_s", "generated tokens / s"))


EVAL_CURVE = ("eval_accuracy", "held-out accuracy (trainer.eval_every)")  # at the steps that evaluated


def shown_curves(metrics: list[dict]) -> tuple[tuple[str, str], ...]:
    """The curves of a run: reward, valid fraction and alpha; the held-out accuracy where trainer.eval_every
    evaluated during training; with a version lag or a correction, the off-policy ones too (lag, importance
    weights, rejections, KL to the behaviour policy, each side's idle time, tokens/s)."""
    evaluated = (EVAL_CURVE,) if any(EVAL_CURVE[0] in m for m in metrics) else ()
    off_policy = any(m.get("version_lag_max") or "is_weight_mean" in m for m in metrics)
    return CURVES + evaluated + (OFF_POLICY_CURVES if off_policy else ())
RIGHT_IOU = 0.5  # a grounding prediction is right at box IoU >= 0.5 with the target
RIGHT_ACCURACY = 0.5  # otherwise when its accuracy reward is >= 0.5 (the 0/1 rewards: when it is 1)
SAMPLES_SHOWN = 8  # predictions.html shows this many samples of a row (eval.samples=k); predictions.jsonl holds all
TRUTH_RGBA, PRED_RGBA = (22, 163, 74, 110), (217, 70, 239, 120)  # mask overlay colours


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def esc(value) -> str:
    """Text as HTML: every <, >, &, and quote escaped (attributes too)."""
    return html.escape(str(value), quote=True)


# ---------------------------------------------------------------------------------------------
# rollouts.html
# ---------------------------------------------------------------------------------------------
def write_rollouts_html(output_dir: str | Path, warn: Callable[[str], None] = _warn) -> Path:
    """Write `output_dir/rollouts.html` (see the module doc); its path. A step file that cannot be read or shown
    is left out, with one warning naming it (`warn`)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise UserError(f"{str(output_dir)!r} is not a folder; pass a training run's output_dir to scripts/view.py.")
    steps = read_steps(output_dir, warn)
    if not steps:
        raise UserError(f"{str(output_dir)!r} has no rollouts/step-<N>.json; train with trainer.log_rollouts_every=N "
                        "(N > 0, the default is 10) and view that run's output_dir.")
    metrics = read_metrics(output_dir / "metrics.jsonl")
    if metrics:  # a run resumed from an earlier step: files past its last metrics line are from the abandoned part
        steps = [s for s in steps if s["step"] <= metrics[-1]["step"]] or steps
    summary = _read_json(output_dir / "summary.json")
    images = output_dir / "rollouts" / "images"
    by_step = {m.get("step"): m for m in metrics}
    shown = []  # (record, its html): a record the page cannot show is left out, named in a warning
    for record in steps:
        try:
            shown.append((record, step_html(record, by_step.get(record["step"], {}), images)))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OSError) as error:
            warn(f"skipped rollouts/step-{record['step']}.json: it cannot be shown ({type(error).__name__}: "
                 f"{error}); the page shows the other steps.")
    if not shown:
        raise UserError(f"no rollouts/step-<N>.json of {str(output_dir)!r} could be shown (see the warnings above); "
                        "train again with trainer.log_rollouts_every=N to log new ones.")
    steps = [record for record, _ in shown]
    body = [
        f"<h1>Rollouts: {esc(output_dir.name)}</h1>",
        f"<div class='sub'>task {esc(steps[-1].get('task', '?'))}"
        + (f", model {esc(summary['model'])}" if summary.get("model") else "")
        + f"; {len(steps)} logged steps of {len(metrics) or '?'}; groups of the main process only</div>",
        curves_html(metrics, [s["step"] for s in steps]),
        "<div class='controls'><label>step <select id='step'>"
        + "".join(f"<option value='{s['step']}'{' selected' if s is steps[-1] else ''}>{s['step']}</option>"
                  for s in steps)
        + "</select></label><button id='prev' type='button'>&larr;</button>"
          "<button id='next' type='button'>&rarr;</button>"
          "<label>groups <select class='filter' id='state'><option value=''>all</option>"
          "<option value='valid'>valid</option><option value='invalid'>invalid</option>"
          "<option value='first'>first rollout</option><option value='resampled'>resampled</option>"
          "</select></label><span id='shown'></span>"
          "<span class='legend'>colour: advantage (<span style='color:#15803d'>+</span> / "
          "<span style='color:#b91c1c'>&minus;</span>)</span></div>",
    ]
    body.extend(page for _, page in shown)
    return _write_page(output_dir / "rollouts.html", f"rollouts: {output_dir.name}", body)


def step_html(record: dict, metrics: dict, images: Path) -> str:
    step = record["step"]
    counts = ", ".join(f"{valid}/{groups}" for valid, groups in zip(record["valid_per_attempt"],
                                                                     record["groups_per_attempt"], strict=True))
    facts = [f"{record['attempts']} rollout(s), valid groups {counts} (this process)"]
    facts += [f"{label} {_fmt(metrics[key])}" for key, label in shown_curves([metrics]) if key in metrics]
    parts = [f"<section class='step' data-step='{step}'><h2>step {step}</h2><div class='sub'>{esc('; '.join(facts))}"
             "</div>"]
    names, weights = record["reward_names"], record["reward_weights"]
    for index, group in enumerate(record["groups"]):
        parts.append(group_html(group, names, weights, images, f"s{step}g{index}"))
    parts.append("</section>")
    return "".join(parts)


def group_html(group: dict, names: list[str], weights: dict, images: Path, key: str) -> str:
    """One group: its image (boxes drawn) and prompt on the left, its completions side by side; in a mixture
    (task=mix) labelled with its task, whose rewards it shows."""
    names, weights = group.get("reward_names", names), group.get("reward_weights", weights)
    valid = "valid" if group["valid"] else "invalid"
    origin = "first" if group["attempt"] == 0 else "resampled"
    completions = group["completions"]
    scale = max((abs(c["advantage"]) for c in completions if isinstance(c["advantage"], float)), default=0.0)
    boxes = [(f"{key}c{g}", c.get("box"), str(g)) for g, c in enumerate(completions)]
    points = [(f"{key}c{g}", c.get("point"), str(g)) for g, c in enumerate(completions)]
    crops = [crop for g, c in enumerate(completions) for crop in crop_boxes(c.get("turns"), f"{key}c{g}", f"{g}.")]
    image = ""
    if group["images"]:
        data = (images / group["images"][0]).read_bytes()
        image = image_svg(data, group["image_sizes"][0], group.get("target_box"), boxes if "target_box" in group
                          else [], [], crops, points)
        image += "".join(f"<img alt='image {i + 2}' width='80' src='{_data_uri((images / name).read_bytes())}'>"
                         for i, name in enumerate(group["images"][1:]))
    cards = []
    for g, c in enumerate(completions):
        scores = " + ".join(f"{esc(n)} {_fmt(c['components'].get(n))}"
                            + (f"&times;{_fmt(weights[n])}" if weights.get(n, 1.0) != 1.0 else "") for n in names)
        end = "EOS" if c["end"] == "eos" else "cut off"
        more = f" (first {len(c['text'])} of {c['chars']} characters)" if c["truncated"] else ""
        box = f"<br>box {esc(_box_text(c['box']))}" if "box" in c and (c["box"] or "point" not in c) else ""
        box += f"<br>click {esc(_box_text(c['point']))}" if "point" in c else ""
        colour = advantage_colour(c["advantage"], scale)
        body = turns_html(c, f"{key}c{g}", lambda crop: _stored_crop(images, crop)) if "turns" in c else \
            f"<pre>{esc(c['text'])}</pre>"
        body += scored_tokens_html(c["scored"]) if "scored" in c else ""
        cards.append(
            f"<div class='completion' data-box='{key}c{g}' style='background:{colour}'>"
            f"<div class='scores'><b>#{g}</b> reward <b>{_fmt(c['reward'])}</b> = {scores}<br>"
            f"advantage <b>{_fmt(c['advantage'])}</b>; {c['tokens']} tokens, {end}{esc(more)}{box}</div>"
            f"{body}</div>")
    prompt_more = f" [first {len(group['prompt'])} of {group['prompt_chars']} characters]" \
        if group["prompt_truncated"] else ""
    tags = json.dumps([valid, origin])
    return (f"<article class='group item {valid}' data-tags='{esc(tags)}'><div class='side'>{image}"
            f"<div><span class='badge {valid}'>{valid}</span><span class='badge {origin}'>"
            f"{'rollout 1' if origin == 'first' else 'resampled, rollout ' + str(group['attempt'] + 1)}</span>"
            + (f"<span class='badge task'>task {esc(group['task'])}</span>" if group.get("task") else "")
            + f"</div><div class='fields'>{esc(group['id'])}; target <b>{esc(group['target'])}</b>"
            f"</div><div class='prompt'>{esc(group['prompt'] + prompt_more)}</div></div>"
            f"<div class='completions'>{''.join(cards)}</div></article>")


def crop_boxes(turns: list[dict] | None, key: str, prefix: str) -> list[tuple[str, Sequence[float], str]]:
    """(box id, box in the prompt image's pixels, label `prefix` + turn) of each crop of a trajectory's turns that
    shows the prompt's first image."""
    return [(f"{key}t{k}", crop["box"], f"{prefix}{k + 1}") for k, turn in enumerate(turns or [])
            for crop in (turn.get("call") or {}).get("crops", []) if crop.get("source") == 0 and crop.get("box")]


def turns_html(record: dict, key: str, thumbnail: Callable[[dict], bytes | None]) -> str:
    """A trajectory turn by turn (`trajectory_record`'s `turns`): each segment's text, then its tool call, the
    observation's text and the crops it returned (`thumbnail(crop)`: its JPEG, or None when not kept); each turn
    highlights its crop's box on the image (id `key` + t + turn)."""
    limit = record.get("limit", "none")
    parts = [f"<div class='turns'><div class='fields'>{len(record['turns'])} turn(s), "
             f"{esc(record.get('generated', '?'))} generated tokens, {record['tool_errors']} tool error(s)"
             + (f"; ended by the {esc(limit)} limit" if limit != "none" else "") + "</div>"]
    for k, turn in enumerate(record["turns"]):
        more = f" (first {len(turn['text'])} of {turn['chars']} characters)" if turn.get("truncated") else ""
        parts.append(f"<div class='turn' data-box='{key}t{k}'><div class='turn-head'>turn {k + 1}{esc(more)}</div>"
                     f"<pre>{esc(turn['text'])}</pre>")
        call = turn.get("call")
        if call is not None:
            state = " error" if call["error"] else ""
            cell = _code_cell(call["arguments"])
            if cell is not None:  # the python tool: its code cell, then what it printed and showed
                parts.append(f"<div class='call{state}'>&#8594; <b>{esc(call['name'] or '?')}</b> ran</div>"
                             f"<pre class='cell'>{esc(cell)}</pre>")
            else:
                parts.append(f"<div class='call{state}'>&#8594; <b>{esc(call['name'] or '?')}</b>"
                             f"(<code>{esc(call['arguments'])}</code>)</div>")
            if call["text"]:
                label = "<div class='out-head'>output</div>" if cell is not None else ""
                parts.append(f"{label}<pre class='observation{state}'>{esc(call['text'])}</pre>")
            for crop in call["crops"]:
                jpeg = thumbnail(crop)
                where = (f"box {esc(_box_text(crop['box']))} of image {crop['source']}" if crop["source"] >= 0
                         else "an image the tool made")
                picture = f"<img alt='crop' class='crop' src='{_data_uri(jpeg)}'>" if jpeg else "(thumbnail not kept)"
                parts.append(f"<div class='crop'>{picture}<span>{where}</span></div>")
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


def _code_cell(arguments: str) -> str | None:
    """The code of a call whose arguments (JSON text) are a code cell ({"code": ...}), else None."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return parsed["code"] if isinstance(parsed, dict) and isinstance(parsed.get("code"), str) else None


def _stored_crop(images: Path, crop: dict) -> bytes | None:
    """A rollout log's crop thumbnail (under rollouts/images/), or None when the log did not keep it."""
    return (images / crop["image"]).read_bytes() if crop.get("image") else None


def scored_tokens_html(scored: dict) -> str:
    """With a teacher: the completion's tokens, each coloured by log teacher - log student (green where the teacher
    likes the token more than the student, red where less, stronger up to a gap of 2 nats), both log-probs in its
    tooltip: where the two disagree."""
    spans = []
    for token, student, teacher in zip(scored["tokens"], scored["student"], scored["teacher"], strict=True):
        gap = teacher - student
        strength = min(abs(gap) / 2.0, 1.0)
        colour = f"hsl({130 if gap > 0 else 0}, 65%, {97 - 35 * strength:.0f}%)"
        spans.append(f"<span class='tok' style='background:{colour}' title='student {student:.3f}, teacher "
                     f"{teacher:.3f}'>{esc(token)}</span>")
    return f"<div class='scored'><b>teacher - student log-prob per token</b><br>{''.join(spans)}</div>"


def advantage_colour(advantage: float | str, scale: float) -> str:
    """A card's background: green for a positive advantage, red for a negative one, stronger the larger it is
    (relative to the group's largest); grey for a non-finite or zero one."""
    if not isinstance(advantage, float) or scale <= 0 or advantage == 0:
        return "#f3f4f6"
    strength = min(abs(advantage) / scale, 1.0)
    hue = 130 if advantage > 0 else 0
    return f"hsl({hue}, 65%, {95 - 22 * strength:.0f}%)"


def image_svg(jpeg: bytes, size: Sequence[int], target: Sequence[float] | None,
              predicted: list[tuple[str, Sequence[float] | None, str]], masks: list[tuple[bytes, str]],
              crops: Sequence[tuple[str, Sequence[float], str]] = (),
              points: Sequence[tuple[str, Sequence[float] | None, str]] = ()) -> str:
    """An image in an SVG whose coordinates are the ORIGINAL image's pixels (`size` = (W, H)): the thumbnail
    stretched over it, mask overlays (PNG), the target box, each predicted box (id, box, label), each box a
    tool cropped (id, box, label) and each predicted click (id, (x, y), label: a ring with a cross; the id goes to
    the box when the answer gave one, so that both highlight with their completion)."""
    width, height = (int(v) for v in size)
    parts = [f"<svg class='view' viewBox='0 0 {width} {height}' preserveAspectRatio='xMidYMid meet' "
             f"xmlns='http://www.w3.org/2000/svg'>"
             f"<image href='{_data_uri(jpeg)}' x='0' y='0' width='{width}' height='{height}' "
             "preserveAspectRatio='none'/>"]
    parts += [f"<image class='mask {kind}' href='{_data_uri(png, 'image/png')}' x='0' y='0' width='{width}' "
              f"height='{height}' preserveAspectRatio='none'/>" for png, kind in masks]
    font = max(width, height) / 18
    for box_id, box, label in predicted:
        if box is not None:
            x1, y1, x2, y2 = box
            parts.append(f"<rect class='pred' id='{box_id}' x='{x1:g}' y='{y1:g}' width='{x2 - x1:g}' "
                         f"height='{y2 - y1:g}'/><text x='{x1:g}' y='{y1 + font:g}' font-size='{font:g}'>"
                         f"{esc(label)}</text>")
    boxed = {box_id for box_id, box, _ in predicted if box is not None}
    for point_id, point, label in points:
        if point is not None:
            parts.append(click_svg(point, font, "" if point_id in boxed else point_id, "" if point_id in boxed
                                   else label))
    for box_id, box, label in crops:
        x1, y1, x2, y2 = box
        parts.append(f"<rect class='crop' id='{box_id}' x='{x1:g}' y='{y1:g}' width='{x2 - x1:g}' "
                     f"height='{y2 - y1:g}'/><text class='crop' x='{x1:g}' y='{y2 - font / 4:g}' "
                     f"font-size='{font:g}'>{esc(label)}</text>")
    if target is not None:
        x1, y1, x2, y2 = target
        parts.append(f"<rect class='truth' x='{x1:g}' y='{y1:g}' width='{x2 - x1:g}' height='{y2 - y1:g}'/>")
    parts.append("</svg>")
    if target is not None or any(box is not None for _, box, _ in predicted) or masks:
        parts.append("<div class='legend'><span class='t'>&#9632;</span> target"
                     " <span class='p'>&#9632;</span> predicted (original pixels)"
                     + (" <span class='p'>&#8853;</span> click" if any(p is not None for _, p, _ in points) else "")
                     + "</div>")
    if crops:
        parts.append("<div class='legend'><span class='c'>&#9632;</span> cropped by a tool "
                     "(completion.turn; original pixels)</div>")
    return "".join(parts)


def click_svg(point: Sequence[float], font: float, point_id: str, label: str) -> str:
    """A click at (x, y), original pixels: a ring with a cross, sized to the image (`font`), labelled."""
    x, y = float(point[0]), float(point[1])
    r = font / 2.5
    ident = f" id='{point_id}'" if point_id else ""
    text = f"<text x='{x + r:g}' y='{y - r:g}' font-size='{font:g}'>{esc(label)}</text>" if label else ""
    return (f"<g class='click'{ident}><circle cx='{x:g}' cy='{y:g}' r='{r:g}'/><line x1='{x - 1.6 * r:g}' y1='{y:g}' "
            f"x2='{x + 1.6 * r:g}' y2='{y:g}'/><line x1='{x:g}' y1='{y - 1.6 * r:g}' x2='{x:g}' y2='{y + 1.6 * r:g}'/>"
            f"</g>{text}")


def curves_html(metrics: list[dict], marked: Sequence[int]) -> str:
    """The run's reward, valid fraction and alpha over the steps (and `shown_curves`' off-policy ones), as inline
    SVG; logged steps marked."""
    if not metrics:
        return "<div class='sub'>no metrics.jsonl: no curves</div>"
    charts = []
    for key, label in shown_curves(metrics):
        points = [(m["step"], float(m[key])) for m in metrics
                  if isinstance(m.get(key), (int, float)) and math.isfinite(float(m[key]))]
        charts.append(f"<div class='curve'><div class='label'>{esc(label)}"
                      + (f": {_fmt(points[-1][1])} at step {points[-1][0]}" if points else "")
                      + f"</div>{svg_curve(points, marked)}</div>")
    return f"<div class='curves'>{''.join(charts)}</div>"


def svg_curve(points: list[tuple[int, float]], marked: Sequence[int], width: int = 300, height: int = 110) -> str:
    """A line chart of (step, value) points with its y range and step range written on it."""
    left, right, top, bottom = 34, 6, 6, 16
    if not points:
        return f"<svg width='{width}' height='{height}'><text x='40' y='50'>no values</text></svg>"
    steps, values = [p[0] for p in points], [p[1] for p in points]
    low, high = min(values), max(values)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    first, last = min(steps), max(steps)
    span = max(last - first, 1)

    def x(step):
        return left + (step - first) / span * (width - left - right)

    def y(value):
        return top + (high - value) / (high - low) * (height - top - bottom)

    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
    by_step = dict(points)
    marks = "".join(f"<circle class='mark' cx='{x(s):.1f}' cy='{y(by_step[s]):.1f}' r='2.6'>"
                    f"<title>step {s}: rollouts logged</title></circle>" for s in marked if s in by_step)
    return (f"<svg width='{width}' height='{height}' viewBox='0 0 {width} {height}'>"
            f"<line x1='{left}' y1='{top}' x2='{left}' y2='{height - bottom}' stroke='#bbb'/>"
            f"<line x1='{left}' y1='{height - bottom}' x2='{width - right}' y2='{height - bottom}' stroke='#bbb'/>"
            f"<text x='2' y='{top + 8}'>{_fmt(high)}</text><text x='2' y='{height - bottom}'>{_fmt(low)}</text>"
            f"<text x='{left}' y='{height - 3}'>{first}</text>"
            f"<text x='{width - right}' y='{height - 3}' text-anchor='end'>step {last}</text>"
            f"<polyline points='{line}'/>{marks}</svg>")


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# predictions.html
# ---------------------------------------------------------------------------------------------
def write_predictions_html(path: str | Path, task, records: Sequence[dict], rows: Sequence[dict],
                           metrics: dict[str, float], *, split: str = "", samples_shown: int = SAMPLES_SHOWN) -> Path:
    """Write an evaluation's page (see the module doc). `rows` are the split's rows, indexed by each record's
    `index` (their images are read once more, here); `samples_shown`: the most samples of one row shown."""
    columns = tuple(getattr(task, "group_columns", ()))
    cards, tallies, right_count = [], {}, 0  # tallies: (column, value) -> [right, count]
    per_row: dict[int, int] = {}  # row index -> its records so far
    for record in records:
        row = rows[int(record["index"])]
        right = is_right(task, record, row)
        right_count += right
        groups = [(column, str(row[column])) for column in columns if row.get(column) is not None]
        for group in groups:
            tally = tallies.setdefault(group, [0, 0])
            tally[0] += right
            tally[1] += 1
        per_row[int(record["index"])] = seen = per_row.get(int(record["index"]), 0) + 1
        if seen <= samples_shown:
            cards.append(prediction_html(task, record, row, right, groups))
    hidden = len(records) - sum(min(count, samples_shown) for count in per_row.values())
    hidden_text = (f"; the page shows the first {samples_shown} samples of each row, {hidden} more are in "
                   "predictions.jsonl" if hidden else "")
    body = [
        f"<h1>Predictions: {esc(task.name)}{' / ' + esc(split) if split else ''}</h1>",
        f"<div class='sub'>{len(records)} predictions of {len(per_row)} rows, {right_count} right "
        f"({esc(right_rule(task))}){esc(hidden_text)}</div>",
        "<div class='tables'>" + metrics_table(metrics) + breakdown_tables(columns, tallies) + "</div>",
        "<div class='controls'><label>show <select class='filter' id='verdict'><option value=''>all</option>"
        "<option value='right'>right</option><option value='wrong'>wrong</option></select></label>"
        "<label>group <select class='filter' id='group'><option value=''>all</option>"
        + "".join(f"<option value='{esc(c)}={esc(v)}'>{esc(c)} = {esc(v)}</option>" for c, v in sorted(tallies))
        + "</select></label><span id='shown'></span></div>",
        f"<section class='predictions'>{''.join(cards)}</section>",
    ]
    return _write_page(Path(path), f"predictions: {task.name}", body)


def right_rule(task) -> str:
    if getattr(task, "prediction_rule", None):  # GUI grounding: ScreenSpot's hit
        return task.prediction_rule
    if task.uses_boxes:
        return f"right: box IoU with the target >= {RIGHT_IOU}"
    return f"right: accuracy reward >= {RIGHT_ACCURACY}"


def is_right(task, record: dict, row: dict) -> bool:
    """Whether a prediction counts as right on the page (`right_rule`)."""
    if getattr(task, "prediction_right", None) is not None:
        return bool(task.prediction_right(record["completion"], row))
    if task.uses_boxes:
        box, target = answer_box(record["completion"]), row.get("box")
        return box is not None and target is not None and box_iou(box, target) >= RIGHT_IOU
    return float(record.get("rewards", {}).get("accuracy", 0.0)) >= RIGHT_ACCURACY


def prediction_html(task, record: dict, row: dict, right: bool, groups: list[tuple[str, str]]) -> str:
    verdict = "right" if right else "wrong"
    images = message_images(task.messages(row))
    picture = ""
    if images:
        size = (images[0].width, images[0].height)
        drawn = drawn_answer(task, record["completion"])
        box, point = drawn.get("box"), drawn.get("point")
        masks = []  # when a segmenter ran: its mask over the ground-truth one
        if record.get("pred_mask") is not None:
            masks = [(mask_png(mask, colour), kind) for mask, colour, kind in
                     ((row.get("mask_rle"), TRUTH_RGBA, "truth"), (record["pred_mask"], PRED_RGBA, "pred"))
                     if mask is not None]
        picture = image_svg(thumbnail_jpeg(images[0]), size, row.get("box") if task.uses_boxes else None,
                            [(f"p{record['index']}", box, "")] if box is not None else [], masks,
                            crop_boxes(record.get("turns"), f"p{record['index']}", ""),
                            [(f"p{record['index']}", point, "")] if point is not None else [])
    rewards = ", ".join(f"{esc(name)} {_fmt(value)}" for name, value in record.get("rewards", {}).items())
    tags = json.dumps([verdict, *[f"{column}={value}" for column, value in groups]])
    group_text = "; ".join(f"{column} {value}" for column, value in groups)
    return (f"<article class='card item' data-tags='{esc(tags)}'><div class='side'>{picture}"
            f"<div class='prompt'>{esc(record.get('prompt', ''))}</div></div><div class='body'>"
            f"<div><span class='badge {verdict}'>{verdict}</span> <b>{esc(record['id'])}</b> {esc(group_text)}</div>"
            f"<div class='fields'>answer <b>{esc(record.get('answer'))}</b>; target <b>{esc(task.target(row))}</b>"
            f"<br>{rewards}" + ("; mask by the segmenter" if record.get("pred_mask") else "") + "</div>"
            + (turns_html(record, f"p{record['index']}", lambda crop: _cut_crop(images, crop)) if "turns" in record
               else f"<pre data-box='p{record['index']}'>{esc(record['completion'])}</pre>") + "</div></article>")


def _cut_crop(images: list, crop: dict) -> bytes | None:
    """A crop's thumbnail cut again from the row's original image (crops are always cut from the original); an
    image a tool made, from the record itself (`jpeg`)."""
    if crop.get("jpeg"):
        return base64.b64decode(crop["jpeg"])
    if not 0 <= crop["source"] < len(images) or not crop.get("box"):
        return None
    return thumbnail_jpeg(images[crop["source"]].crop(tuple(round(v) for v in crop["box"])), max_edge=160)


def mask_png(rle: dict, rgba: tuple[int, int, int, int], max_edge: int = 256) -> bytes:
    """A COCO RLE mask as a transparent PNG overlay (the mask in `rgba`), at most `max_edge` px a side."""
    from pycocotools import mask as mask_utils

    counts = rle["counts"]
    decoded = mask_utils.decode({"size": list(rle["size"]), "counts": counts.encode() if isinstance(counts, str)
                                 else counts}).astype(bool)  # [H, W]
    pixels = np.zeros((*decoded.shape, 4), dtype=np.uint8)
    pixels[decoded] = rgba
    image = Image.fromarray(pixels, "RGBA")
    image.thumbnail((max_edge, max_edge), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def metrics_table(metrics: dict[str, float]) -> str:
    rows = "".join(f"<tr><td>{esc(name)}</td><td>{_fmt(value)}</td></tr>" for name, value in metrics.items()
                   if isinstance(value, (int, float)))
    return f"<table class='metrics'><tr><th>metric</th><th>value</th></tr>{rows}</table>"


def breakdown_tables(columns: Sequence[str], tallies: dict[tuple[str, str], list[int]]) -> str:
    """Per group column, each value's rows, right ones and accuracy; a value's button filters the cards to it."""
    tables = []
    for column in columns:
        values = sorted((value, tally) for (c, value), tally in tallies.items() if c == column)
        if not values:
            continue
        lines = "".join(
            f"<tr><td><button type='button' data-filter-id='group' data-filter-value='{esc(column)}={esc(value)}'>"
            f"{esc(value)}</button></td><td>{count}</td><td>{right}</td><td>{right / count:.3f}</td></tr>"
            for value, (right, count) in values)
        tables.append(f"<table class='breakdown'><tr><th>{esc(column)}</th><th>rows</th><th>right</th>"
                      f"<th>accuracy</th></tr>{lines}</table>")
    return "".join(tables)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _write_page(path: Path, title: str, body: list[str]) -> Path:
    css, script = (ASSETS / "viewer.css").read_text(), (ASSETS / "viewer.js").read_text()
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><style>{css}</style></head>"
            f"<body><div id='js-error' hidden></div>{''.join(body)}<script>{script}</script></body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return esc(value)
    return esc(f"{float(value):.4g}")


def _box_text(box) -> str:
    return "none" if box is None else "[" + ", ".join(f"{v:g}" for v in box) + "]"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
