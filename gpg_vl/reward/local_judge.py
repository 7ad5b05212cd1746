"""`reward.judge.kind=local`: a judge model loaded on the run's device that always gives a verdict, without free
generation.

The model (`reward.judge.model`: a folder, a hub id already in the local cache, `embedded:<name>` or
`tiny:<family>`) loads through the model families (gpg_vl/models/load.py's `load_policy`, the chat template
with thinking off), in eval mode with no gradient. One forward pass over the judge's prompt (gpg_vl/reward/judge.py's
`PROMPT`, rendered by the family's chat template with the generation prompt) gives the next token's log-probs;
the verdict is 1.0 when log p("yes") > log p("no"), else 0.0, "yes" and "no" being the first token of each
word as the tokenizer encodes it right after the assistant prefix. The model never samples, so every question
gets a verdict (a tie is "no").

Completions are scored on several threads (gpg_vl/reward/pool.py), and a batch's questions are asked at once
(`concurrency` = `batch_size`): questions asked while a forward pass runs wait for it and then go together in the
next one (at most `batch_size`, left-padded), so one reward call's questions share a few forward passes. A forward
pass that fails gives its questions no score (`MISSING`, gpg_vl/reward/judge.py). Verdicts are memoised as the
endpoint judge's. A model served by vLLM (`vllm serve`) is a judge too, in either mode: reach it with
`reward.judge.kind=endpoint`; this judge gives verdicts only (`reward.judge.mode=verdict`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from gpg_vl.errors import UserError
from gpg_vl.reward.judge import JUDGES, Judge, JudgeError, Question, judge_prompt

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # `org/name` or `name`: a hub id rather than a path


class _Slot:
    """A question waiting for its verdict (or the error that stopped its forward pass)."""

    def __init__(self) -> None:
        self.done, self.verdict, self.error = False, 0.0, ""


def judge_messages(question: Question) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": judge_prompt(question)}]}]


def answer_token(family, word: str) -> int:
    """The first token of `word` as the family's tokenizer encodes it right after the assistant prefix."""
    prefix = family.render(judge_messages(("?", "?", "?")))
    tokenizer = family.tokenizer
    before = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    after = tokenizer(prefix + word, add_special_tokens=False)["input_ids"]
    shared = min(len(before), len(after))
    same = next((k for k in range(shared) if before[k] != after[k]), shared)  # where the word's tokens begin
    if same >= len(after):
        raise UserError(f"the judge model's tokenizer encodes no token for {word!r} after its assistant prefix; "
                        "give reward.judge.model a chat model with a usual tokenizer.")
    return int(after[same])


class LocalJudge(Judge):
    """The judge of a loaded `policy` (gpg_vl/models/load.py's `Policy`); `batch_size`: questions per forward."""

    def __init__(self, policy, *, batch_size: int = 16) -> None:
        super().__init__()
        self.model, self.family, self.batch_size = policy.model, policy.family, int(batch_size)
        self.concurrency = self.batch_size  # a batch's questions asked at once share forward passes
        self.model.eval()
        self.model.requires_grad_(False)
        self.yes_id, self.no_id = answer_token(self.family, "yes"), answer_token(self.family, "no")
        if self.yes_id == self.no_id:
            raise UserError("the judge model's tokenizer starts yes and no with the same token, so its log-probs "
                            "cannot tell them apart; give reward.judge.model another model.")
        self._pending: OrderedDict[Question, _Slot] = OrderedDict()
        self._forward = threading.Lock()  # one forward pass at a time; it takes every question then waiting
        self.forwards = 0  # forward passes run
        self.judged = 0  # questions judged (the memo answers repeats)

    @torch.no_grad()
    def margins(self, questions: list[Question]) -> torch.Tensor:
        """log p("yes") - log p("no") [K] of the next token after each question's judge prompt, in one pass."""
        batch = self.family.encode([judge_messages(q) for q in questions])
        device = next(self.model.parameters()).device
        inputs = {key: value.to(device) for key, value in batch.inputs.items()}
        positions = self.family.position_ids(self.model, inputs)  # left padding: positions from the mask
        extra = {} if positions is None else {"position_ids": positions}
        logits = self.model(**inputs, **extra, use_cache=False, logits_to_keep=1).logits[:, -1].float()  # [K, V]
        logps = logits.log_softmax(-1)  # [K, V]
        return logps[:, self.yes_id] - logps[:, self.no_id]  # [K]

    def decide(self, question: Question) -> float:
        with self._lock:
            slot = self._pending.setdefault(question, _Slot())
        with self._forward:
            while not slot.done:  # the questions waiting, this one among them, `batch_size` at a time
                with self._lock:
                    taken = [self._pending.popitem(last=False) for _ in range(min(self.batch_size,
                                                                                  len(self._pending)))]
                self._run(taken)
        if slot.error:
            raise JudgeError(slot.error)
        return slot.verdict

    def _run(self, taken: list[tuple[Question, _Slot]]) -> None:
        """One forward pass over the `taken` questions; every slot ends done, with its verdict or the error."""
        try:
            margins = self.margins([question for question, _ in taken]).tolist()
            for (_, slot), margin in zip(taken, margins, strict=True):
                slot.verdict = 1.0 if margin > 0 else 0.0
        except Exception as error:  # an out-of-memory error, a family that cannot encode: each question fails
            for _, slot in taken:
                slot.error = f"the local judge failed ({type(error).__name__}: {str(error)[:200]})"
        finally:
            for _, slot in taken:
                slot.done = True
            self.forwards += 1
            self.judged += len(taken)


def judge_model_path(name: str) -> str:
    """`reward.judge.model` (set: the settings made sure) checked before it loads: an existing folder unless a
    hub id."""
    from gpg_vl.models.load import resolve_path

    path = resolve_path(str(name))
    if not Path(path).expanduser().exists() and not _HUB_ID.fullmatch(path):
        raise UserError(f"reward.judge.model={name!r} does not exist; give a local model folder or a hub id.")
    return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path


@JUDGES.register("local")
def local_judge(settings, device) -> LocalJudge:
    """`reward.judge.kind=local`: `LocalJudge` of reward.judge.model, loaded on `device` (the run's)."""
    from gpg_vl.config.schema import ModelSettings
    from gpg_vl.models.load import load_policy

    if settings.mode != "verdict":
        raise UserError(f"reward.judge.kind=local compares the log-probs of yes and no, so it gives verdicts only, "
                        f"not reward.judge.mode={settings.mode}; serve the judge model (vllm serve) and set "
                        "reward.judge.kind=endpoint reward.judge.url=<its URL>.")
    path = judge_model_path(settings.model)
    policy = load_policy(ModelSettings(name_or_path=path, enable_thinking=False), device,
                         setting="reward.judge.model")
    return LocalJudge(policy, batch_size=settings.batch_size)
