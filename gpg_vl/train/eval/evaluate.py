"""Batched decoding on held-out rows, scored by the task's metrics: one greedy completion per row by default, or
`eval.samples` = k sampled completions per row at `eval.temperature` (`Decoding`), reported as mean@k, pass@k,
maj@k and their standard errors, per benchmark and per category (gpg_vl/train/eval/at_k.py), beside the task's own
metrics averaged over the k sample sets.

Each row is read once (reading a row can decode its image): the decoding pass keeps what scoring and
reporting need (the prompt text and the row without its images, plus what the task's optional
`prediction_fields` derives while the images are at hand: lisa's predicted masks), so nothing is read twice.
Each batch's completions are scored once, as training scores a step's (gpg_vl/reward/pool.py): on
`reward_workers` threads, within `reward_budget_s` of reward time per batch; the metrics and the prediction
records both read those scores. A completion not scored within the budget scores 0 and is counted in the
metrics as `reward_timeouts`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from gpg_vl.data.task import prompt_text
from gpg_vl.distributed import forward_is_collective
from gpg_vl.errors import UserError
from gpg_vl.models.load import Policy
from gpg_vl.reward.pool import RewardBudget, score_within
from gpg_vl.reward.primitives import extract_answer
from gpg_vl.rollout.engine import EnginePrompts, Sampling, encode_prompts
from gpg_vl.rollout.multiturn.trajectory import trajectory_metrics
from gpg_vl.rollout.types import in_task_frame
from gpg_vl.train.eval.at_k import at_k_metrics
from gpg_vl.train.step.placeholder import placeholder_prompts

_RESCORE_CHUNK = 32  # rows (with their images) held at once while re-scoring


@dataclass(frozen=True)
class Decoding:
    """How held-out rows are decoded: `samples` completions per row, greedy at `temperature` 0, else sampled at
    that temperature and `top_p`, from torch's generator seeded with `seed` in a forked state (evaluation during
    training draws the same samples every time and leaves the training's random state as it was)."""

    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def sampling(self, max_new_tokens: int) -> Sampling:
        if self.temperature == 0:
            return Sampling(max_new_tokens=max_new_tokens, greedy=True)
        return Sampling(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    @contextlib.contextmanager
    def random_state(self):
        """The context decoding runs in: as it is for greedy, else a forked generator seeded with `seed`."""
        if self.temperature == 0:
            yield
            return
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(self.seed)
            yield


def decoding(evaluation, rollout, seed: int = 0) -> Decoding:
    """The `Decoding` of `eval.*` (`evaluation`) and `rollout.*`: eval.temperature, else greedy for one sample
    and rollout.temperature for more; rollout.top_p when sampling."""
    samples = int(evaluation.samples)
    temperature = evaluation.temperature
    if temperature is None:
        temperature = 0.0 if samples == 1 else rollout.temperature
    return Decoding(samples=samples, temperature=float(temperature),
                    top_p=float(rollout.top_p) if temperature else 1.0, seed=seed)


@dataclass
class Decoded:
    """One completion of a row (its `sample`-th of `Decoding.samples`), with what is needed to score and report
    it."""

    index: int
    completion: str  # boxes in original pixels
    prompt: str  # the messages' text, images shown as <image>
    row: dict  # the row's columns without its images
    rewards: dict[str, float]  # each reward's score (0 for all when not scored within the budget)
    timed_out: bool = False  # not scored within the batch's reward budget
    trajectory: object = None  # multi-turn (rollout.max_turns > 1): its Trajectory (turns, tool calls, crops)
    sample: int = 0  # which of the row's completions (0 .. eval.samples - 1)
    entropy: tuple[float, int] | None = None  # (summed entropy of its generated tokens, their count), or None


@dataclass(frozen=True)
class Share:
    """Which share of the rows this process decodes: rows rank, rank + world_size, ...; `gather` (e.g.
    accelerate's gather_object) joins the shares when there are several processes."""

    rank: int = 0
    world_size: int = 1
    gather: object = None


def generate_greedy(
    policy: Policy, task, rows: Sequence[dict], *, engine, batch_size: int, max_new_tokens: int,
    share: Share = Share(), reward_workers: int = 4, reward_budget_s: float = 0.0, decoding: Decoding = Decoding(),
) -> list[Decoded]:
    """`decoding.samples` completions for each of `rows` (greedy by default), in order (row, then sample), decoded
    by `engine` (`build_engine`'s: the run's, or rollout.engine's) and scored (see the module doc). Each process
    decodes and scores its own `share` of the rows; `batch_size` counts rows (each decodes k completions)."""
    rank, world_size, gather = share.rank, share.world_size, share.gather
    sampling, k = decoding.sampling(max_new_tokens), decoding.samples
    local = list(range(rank, len(rows), world_size))
    decoded: list[Decoded] = []
    # Under FSDP / ZeRO-3 generate is collective, so every process makes the same number of calls: a
    # process whose share ran out decodes a placeholder prompt and keeps nothing.
    calls = math.ceil(math.ceil(len(rows) / world_size) / batch_size)
    with decoding.random_state():
        for start in range(0, calls * batch_size, batch_size):
            chunk = [(i, rows[i]) for i in local[start:start + batch_size]]
            if not chunk:
                if forward_is_collective(policy.model):
                    engine.generate(EnginePrompts(placeholder_prompts(policy)), k, sampling)
                continue
            decoded += _decode_chunk(policy, task, chunk, engine, sampling, k, reward_workers, reward_budget_s)
    if world_size > 1 and gather is not None:
        decoded = gather(decoded)  # collective: every process reaches it once, after the same number of batches
    return sorted(decoded, key=lambda d: (d.index, d.sample))


def _decode_chunk(policy: Policy, task, chunk: list[tuple[int, dict]], engine, sampling: Sampling, k: int,
                  reward_workers: int, reward_budget_s: float) -> list[Decoded]:
    """One batch of rows: k completions each (row-major), scored within the batch's reward budget."""
    messages = [task.messages(row) for _, row in chunk]
    prompts = encode_prompts(policy, messages, tools=engine.prompt_tools(task))
    rollout = engine.generate(prompts, k, sampling)
    entropies = answer_entropy(policy, prompts.batch, rollout, k)
    trajectories = rollout.trajectories or [None] * (len(chunk) * k)
    texts = in_task_frame(policy, task, rollout.texts, prompts.batch, k)
    scored = _scoring_rows(task, [row for _, row in chunk for _ in range(k)], texts)
    rewards = score_within(task, texts, scored, workers=reward_workers, budget=RewardBudget(reward_budget_s),
                           trajectories=rollout.trajectories)
    zero = dict.fromkeys(task.reward_functions, 0.0)
    prompts_text = [prompt_text(message) for message in messages]
    return [Decoded(chunk[n // k][0], text, prompts_text[n // k], row, dict(zero) if score is None else score,
                    score is None, trajectory, sample=n % k, entropy=entropies[n])
            for n, (text, row, score, trajectory) in enumerate(zip(texts, scored, rewards, trajectories, strict=True))]


@torch.no_grad()
def answer_entropy(policy: Policy, batch, rollout, k: int) -> list[tuple[float, int] | None]:
    """Per completion of `rollout` (k per prompt of `batch`): (the summed entropy of the policy's next-token
    distribution, at temperature 1, over its generated tokens, their count), from one forward without gradient
    through the update's scoring path (gpg_vl/models/scoring.py). None for every completion where that forward
    would be collective (FSDP / ZeRO-3) or the engine refused prompts."""
    from gpg_vl.models import scoring

    count = len(rollout.texts)
    if forward_is_collective(policy.model) or rollout.rejected or not count:
        return [None] * count
    path = scoring.choose_scoring_path(policy.family, policy.model, share_prompt=True, share_vision=True)
    device = rollout.completion_ids.device
    counted = rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask.bool()  # [n, C]
    _, entropy = scoring.token_logps_and_entropy(
        policy.family, policy.model, batch.to(device), [n // k for n in range(count)], rollout.completion_ids,
        rollout.completion_mask, path=path, observations=rollout.trajectories, logits_chunk_tokens=1024)
    sums = torch.where(counted.to(entropy.device), entropy, torch.zeros_like(entropy)).sum(dim=1)  # [n]
    return [(float(total), int(tokens)) for total, tokens in zip(sums, counted.sum(dim=1), strict=True)]


def evaluate(policy: Policy, task, rows: Sequence[dict], **kwargs) -> tuple[dict[str, float], list[Decoded]]:
    """The task's metrics for the completions of `rows` (greedy, or over `decoding.samples`: `sample_metrics`),
    and the decoded completions."""
    decoded = generate_greedy(policy, task, rows, **kwargs)
    samples = kwargs.get("decoding", Decoding()).samples
    metrics = sample_metrics(task, [d.row for d in decoded], [d.completion for d in decoded],
                             [d.rewards for d in decoded], samples)
    if any(d.trajectory is not None for d in decoded):  # multi-turn: turns, tool calls, errors, images, limits
        metrics.update(trajectory_metrics([d.trajectory for d in decoded if d.trajectory is not None]))
    if decoded and all(d.entropy is not None for d in decoded):  # per generated token, greedy or sampled answers
        metrics["entropy_mean"] = entropy_mean([d.entropy for d in decoded])
    timeouts = sum(d.timed_out for d in decoded)
    if timeouts:
        metrics["reward_timeouts"] = float(timeouts)
    if timeouts and kwargs.get("share", Share()).rank == 0:  # every process holds every row's scores: one warning
        print(f"warning: {timeouts} of {len(decoded)} held-out completions were not scored within "
              f"eval.reward_budget_s={kwargs.get('reward_budget_s')} s of reward time per batch and scored 0; raise "
              "it (0 = no budget) or eval.reward_workers.")
    return metrics, decoded


def sample_metrics(task, rows: Sequence[dict], completions: Sequence[str], scores: Sequence[dict],
                   samples: int) -> dict[str, float]:
    """The metrics of `samples` completions per row, given row-major (row i's sample j at i * samples + j).

    One sample: the task's metrics as they are. More: the task's metrics of each sample set (sample j of every
    row) averaged over the sets (so `accuracy` is mean@k), and `at_k_metrics` of the `accuracy` rewards: mean@k,
    pass@k, maj@k over the parsed answers (`parsed_answer`), their standard errors, per `task.group_columns`
    value. Completions with a NaN or infinite score (a judge that gave none) are counted, `rewards_nonfinite`;
    the means that read them are NaN."""
    nonfinite = sum(not all(math.isfinite(value) for value in score.values()) for score in scores)
    counted = {"rewards_nonfinite": float(nonfinite)} if nonfinite else {}
    if samples == 1:
        return {**task_metrics(task, rows, completions, scores), **counted}
    sets = [task_metrics(task, rows[j::samples], completions[j::samples], scores[j::samples]) for j in range(samples)]
    metrics = {name: sum(found[name] for found in sets if name in found) / sum(name in found for found in sets)
               for name in sets[0]}
    if all("accuracy" in score for score in scores):
        count = len(rows) // samples
        accuracy = [[scores[i * samples + j]["accuracy"] for j in range(samples)] for i in range(count)]
        answers = [[parsed_answer(task, completions[i * samples + j]) for j in range(samples)] for i in range(count)]
        columns = getattr(task, "group_columns", ())
        categories = [[row[c] for c in columns if row.get(c) is not None] for row in rows[::samples]]
        metrics.update(at_k_metrics(accuracy, answers, categories))
    return {**metrics, **counted}


def parsed_answer(task, completion: str) -> str | None:
    """The answer a completion gives, as maj@k votes with it: the task's `parsed_answer(completion)` when it has
    one (the reading its rewards use), else the last `<answer>` content; whitespace collapsed, None when empty."""
    reader = getattr(task, "parsed_answer", None)
    answer = reader(completion) if reader is not None else extract_answer(completion)
    answer = None if answer is None else " ".join(str(answer).split())
    return answer or None


def task_metrics(task, rows: Sequence[dict], completions: Sequence[str], scores: Sequence[dict]) -> dict[str, float]:
    """`task.metrics` given the completions' scores already computed (a task whose `metrics` predates the
    `scores` argument scores them itself)."""
    if "scores" in inspect.signature(task.metrics).parameters:
        return task.metrics(rows, completions, scores=scores)
    return task.metrics(rows, completions)


def entropy_mean(entropies: Sequence[Sequence[float]]) -> float:
    """The mean entropy per generated token over completions given as (summed entropy, token count); exactly
    rounded (math.fsum), so that re-scoring a predictions file in its own order gives evaluation's number."""
    return math.fsum(e[0] for e in entropies) / max(sum(int(e[1]) for e in entropies), 1)


def prediction_records(task, decoded: Sequence[Decoded], split: str, tokenizer=None) -> list[dict]:
    """One JSON-ready record per completion: where it came from, what the model said, and each reward's score
    (with several samples per row, every sample, numbered `sample`); a multi-turn row (with the policy's
    `tokenizer`) also its trajectory turn by turn (`turns`: each segment's text, its tool call, the observation,
    the crops' boxes in original pixels; `limit`, `tool_errors`)."""
    from gpg_vl.observe.rollout_log import trajectory_record

    several = any(d.sample for d in decoded)
    return [{
        "index": d.index, "id": str(d.row.get("id", d.index)), "split": split, **({"sample": d.sample} if several
                                                                                 else {}),
        "prompt": d.prompt, "completion": d.completion, "answer": extract_answer(d.completion),
        "target": task.target(d.row), "rewards": d.rewards, **_saved_fields(d.row),
        **({"entropy": list(d.entropy)} if d.entropy is not None else {}),  # (summed over its tokens, their count)
        **(trajectory_record(d.trajectory, tokenizer) if d.trajectory is not None and tokenizer is not None else {}),
    } for d in decoded]


def read_predictions(path: str | Path) -> list[dict]:
    """The records of a predictions.jsonl written by scripts/eval.py, each checked for what `rescore` reads
    (`index` a whole number >= 0, `id`, `completion` a string); a bad file or line (named by its number in the
    file), a file without records, or one holding a record twice, fails in one sentence."""
    source = Path(path)
    if not source.is_file():
        raise UserError(f"predictions file {str(source)!r} does not exist; pass predictions=path/to/predictions.jsonl.")
    records = []
    for number, line in enumerate(source.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:  # its own position is within the line: say the file's line
            raise UserError(f"line {number} of predictions file {str(source)!r} is not JSON ({error.msg} at column "
                            f"{error.colno}); pass a predictions.jsonl written by scripts/eval.py.") from None
        problem = _prediction_problem(record)
        if problem:
            raise UserError(f"line {number} of predictions file {str(source)!r} {problem}; pass a predictions.jsonl "
                            "written by scripts/eval.py (each line holds index, id and completion).")
        records.append(record)
    if not records:
        raise UserError(f"predictions file {str(source)!r} holds no records, so there is nothing to re-score; pass a "
                        "predictions.jsonl written by scripts/eval.py (one record per line).")
    times = Counter((int(record["index"]), int(record.get("sample", 0))) for record in records)
    repeated = sorted(key for key, count in times.items() if count > 1)
    if repeated:
        (index, sample) = repeated[0]
        raise UserError(f"the predictions file {str(source)!r} holds row index {index}'s sample {sample} "
                        f"{times[repeated[0]]} times (a line written twice?); re-score a file written by "
                        "scripts/eval.py, each line once.")
    return records


def _prediction_problem(record) -> str | None:
    """What is wrong with one predictions.jsonl record for re-scoring (None when nothing is)."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a record"
    missing = [key for key in ("index", "id", "completion") if key not in record]
    if missing:
        return f"has no {', '.join(missing)}"
    index = record["index"]
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return f"has index {index!r}, not a row number (a whole number >= 0)"
    if not isinstance(record["completion"], str):
        return f"has a completion of type {type(record['completion']).__name__}, not text"
    sample = record.get("sample", 0)
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        return f"has sample {sample!r}, not a sample number (a whole number >= 0)"
    return None


def rescore(task, records: Sequence[dict], rows: Sequence[dict], *,
            reward_workers: int = 4) -> tuple[dict[str, float], list[dict]]:
    """Score saved completions again against the dataset rows they name, on `reward_workers` threads and
    without a time budget; the policy model is not involved (a task's `prediction_fields`, e.g. lisa's
    segmenter, may run its own). Several samples per row (records with `sample`) are scored as evaluation scores
    them (`sample_metrics`); every row must hold the same number."""
    records, samples = _by_row_and_sample(records)
    completions = [record["completion"] for record in records]
    matched = []
    for start in range(0, len(records), _RESCORE_CHUNK):
        chunk = []
        for record in records[start:start + _RESCORE_CHUNK]:
            index = int(record["index"])
            row = rows[index] if index < len(rows) else None
            if row is None or str(row.get("id", index)) != str(record["id"]):
                raise UserError(f"prediction {record['id']!r} (index {index}) does not match split "
                                f"{record.get('split')!r} of task {task.name!r}; re-score with the same task, "
                                "split and data.path that produced the file.")
            chunk.append(row)
        matched += _scoring_rows(task, chunk, completions[start:start + len(chunk)])
    scores = score_within(task, completions, matched, workers=reward_workers)
    refreshed = [{**{key: value for key, value in record.items() if key != "pred_mask"},  # the segmenter's anew
                  "answer": extract_answer(record["completion"]), "rewards": score, **_saved_fields(row)}
                 for record, row, score in zip(records, matched, scores, strict=True)]
    metrics = sample_metrics(task, matched, completions, scores, samples)
    if all("entropy" in record for record in records):  # the answers' entropy, as evaluation saved it
        metrics["entropy_mean"] = entropy_mean([record["entropy"] for record in records])
    return metrics, refreshed


def _by_row_and_sample(records: Sequence[dict]) -> tuple[list[dict], int]:
    """The records ordered by (index, sample) and the number of samples per row, which every row must share;
    a record without `sample` is its row's only one (a greedy file)."""
    counts: dict[int, int] = {}
    for record in records:
        counts[int(record["index"])] = counts.get(int(record["index"]), 0) + 1
    samples = max(counts.values(), default=1)
    uneven = sorted(index for index, count in counts.items() if count != samples)
    if uneven:
        raise UserError(f"the predictions file holds {samples} samples for some rows but {counts[uneven[0]]} for row "
                        f"index {uneven[0]}; re-score a complete file written by scripts/eval.py.")
    ordered = sorted(records, key=lambda record: (int(record["index"]), int(record.get("sample", 0))))
    for position, record in enumerate(ordered):
        if int(record.get("sample", 0)) != position % samples:
            raise UserError(f"row index {record['index']} of the predictions file does not number its samples 0 to "
                            f"{samples - 1}; re-score a complete file written by scripts/eval.py.")
    return ordered, samples


def _scoring_rows(task, rows: Sequence[dict], completions: Sequence[str]) -> list[dict]:
    """The rows as scoring sees them: without their images, plus what the task's optional
    `prediction_fields(rows, completions)` derives from each row (images included) and its completion."""
    fields = getattr(task, "prediction_fields", None)
    extra = fields(rows, completions) if fields is not None else [{} for _ in rows]
    return [{**_without_images(row), **more} for row, more in zip(rows, extra, strict=True)]


def _saved_fields(row: dict) -> dict:
    """What a scoring row adds to its prediction record: the segmenter's mask (`pred_mask`, a COCO RLE whose
    counts are saved as text), when one ran."""
    mask = row.get("pred_mask")
    if mask is None:
        return {}
    counts = mask["counts"]
    return {"pred_mask": {"size": [int(v) for v in mask["size"]],
                          "counts": counts.decode() if isinstance(counts, bytes) else counts}}


def _without_images(row: dict) -> dict:
    return {key: value for key, value in row.items() if not isinstance(value, Image.Image)}
