"""Batched greedy decoding on held-out rows, scored by the task's metrics."""

from __future__ import annotations

from collections.abc import Sequence

from gpg_vl.errors import UserError
from gpg_vl.models.base import Policy
from gpg_vl.rewards import extract_answer
from gpg_vl.rollout import generate, in_task_frame


def generate_greedy(
    policy: Policy, task, rows: Sequence[dict], *, batch_size: int, max_new_tokens: int, rank: int = 0,
    world_size: int = 1, gather=None, progress=None,
) -> list[str]:
    """Greedy completions for `rows`, in order, boxes in original pixels. Each process decodes its own share;
    `gather` (e.g. accelerate's gather_object) joins the shares when there are several processes."""
    local = list(range(rank, len(rows), world_size))
    texts: list[tuple[int, str]] = []
    for start in range(0, len(local), batch_size):
        chunk = local[start:start + batch_size]
        prompts = policy.adapter.encode([task.messages(rows[i]) for i in chunk])
        rollout = generate(policy, prompts, group_size=1, max_new_tokens=max_new_tokens, do_sample=False)
        texts += list(zip(chunk, in_task_frame(policy, task, rollout.texts, prompts, 1), strict=True))
        if progress is not None:
            progress(len(chunk))
    if world_size > 1 and gather is not None:
        texts = gather(texts)
    return [text for _, text in sorted(texts)]


def evaluate(policy: Policy, task, rows: Sequence[dict], **kwargs) -> tuple[dict[str, float], list[str]]:
    """The task's metrics for greedy completions of `rows`, and the completions."""
    completions = generate_greedy(policy, task, rows, **kwargs)
    return task.metrics(rows, completions), completions


def prediction_records(task, rows: Sequence[dict], completions: Sequence[str], split: str) -> list[dict]:
    """One JSON-ready record per row: where it came from, what the model said, and each reward's score."""
    records = []
    for index, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        records.append({
            "index": index, "id": str(row.get("id", index)), "split": split,
            "prompt": _prompt_text(task.messages(row)), "completion": completion,
            "answer": extract_answer(completion), "target": task.target(row),
            "rewards": task.reward_components(completion, row),
        })
    return records


def rescore(task, records: Sequence[dict], rows: Sequence[dict]) -> tuple[dict[str, float], list[dict]]:
    """Score saved completions again against the dataset rows they name; no model is involved."""
    matched = []
    for record in records:
        index = int(record["index"])
        if index >= len(rows) or str(rows[index].get("id", index)) != str(record["id"]):
            raise UserError(f"prediction {record['id']!r} (index {index}) does not match split "
                            f"{record.get('split')!r} of task {task.name!r}; re-score with the same task, split "
                            "and data.path that produced the file.")
        matched.append(rows[index])
    completions = [record["completion"] for record in records]
    refreshed = [{**record, "answer": extract_answer(record["completion"]),
                  "rewards": task.reward_components(record["completion"], row)}
                 for record, row in zip(records, matched, strict=True)]
    return task.metrics(matched, completions), refreshed


def _prompt_text(messages: list[dict]) -> str:
    parts = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            parts.append(content)
        else:
            parts += ["<image>" if part.get("type") == "image" else part.get("text", "") for part in content]
    return "".join(parts)
