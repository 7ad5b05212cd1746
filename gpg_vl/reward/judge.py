"""An LLM judge as a reward: how well does a model's answer agree with a reference sentence?

DeepEyes' V*-style training rows have sentences as ground truth ("The bag is black."), which no rule matches;
DeepEyes asks Qwen2.5-72B, Mini-o3 GPT-4o. The judge is a run-level setting, `reward.judge.*`
(gpg_vl/config/schema.py's `JudgeSettings`), its kind picked by name from `JUDGES`:

- `none` (the default): no judge; a task whose rows need one skips them with a counted reason (never scores 0);
- `endpoint`: `EndpointJudge` asks any OpenAI-compatible chat-completions endpoint (`vllm serve`, SGLang, TGI,
  a hosted API) through gpg_vl/rollout/vllm/client.py's `Server` (the standard library's urllib: no dependency);
- `local`: `LocalJudge` (gpg_vl/reward/local_judge.py), a model loaded through the model families on the run's
  device, which answers in one forward pass by comparing the log-probs of "yes" and "no".

What the judge is asked and how its reply is read is its mode, `reward.judge.mode`, picked by name from
`JUDGE_MODES` (a `JudgeMode`: a prompt template and a reader): `verdict` (yes or no, 1.0 or 0.0; this module) or
`scale` (a rubric's score, mapped to 0..1; gpg_vl/reward/judge_scale.py).

A task asks for a judge with `uses_judge = True` and reads `task.judge` (None, or a `Judge`: `judge(question,
reference, answer) -> score`); the setup (`gpg_vl/train/build.py`'s `build_judge`) sets it, in training and in
evaluation, so a task never knows where its judge comes from. A task that says which question each completion
puts to the judge (`Task.judge_question`) has a batch's questions sent together, `concurrency` at a time
(gpg_vl/reward/pool.py); scores are memoised (the tool bonus asks the accuracy of a completion again).

A judge that gives no score (a request the server refuses, a reply the mode cannot read) gives `MISSING` (NaN),
never a made-up 0 or 1: the completion's group is left out of the update as any NaN reward is, and the scoring
counts it (`judge_tally`: `judge_missing` per step in metrics.jsonl). A failed question is remembered until the
next step (`Judge.new_step`), so asking it again fails at once. A judge that cannot be reached within
reward.judge.timeout_s (retried meanwhile) is down: `Judge.lost` holds the sentence (an `EngineUnreachable`),
every later question of the step is missing at once, and the scoring raises it, so the run writes a checkpoint and
stops as it does for a lost rollout server (gpg_vl/train/loop.py's stop_on_lost_engine).
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gpg_vl.config.names import JUDGE_BUILTINS, JUDGE_MODE_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.registry import Registry

PROMPT = """You judge whether a model's answer to a question about an image means the same as the reference answer.
The answers are consistent when they state the same fact, however it is worded: "pink" and "It is pink." are
consistent; "left" and "The cup is to the right of the plate." are not. Reply with one word: yes or no.

Question: {question}
Reference answer: {reference}
Model's answer: {answer}
Consistent:"""
_VERDICT = re.compile(r"\W*(yes|no|1|0)\b", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"\{(question|reference|answer|low|high)\}")
MEMO_SIZE = 4096  # scores kept: the tool bonus asks the accuracy of a completion again
MISSING = float("nan")  # the score of a question the judge gave none for

Question = tuple[str, str, str]  # (question, reference, answer)

# reward.judge.kind -> a builder `fn(settings: JudgeSettings, device) -> Judge | None` (None: no judge)
JUDGES = Registry("judge", "reward.judge.kind", JUDGE_BUILTINS,
                  expects="a judge builder (a function of the reward.judge settings and the device)")
# reward.judge.mode -> a builder `fn(settings: JudgeSettings) -> JudgeMode`
JUDGE_MODES = Registry("judge mode", "reward.judge.mode", JUDGE_MODE_BUILTINS,
                       expects="a judge mode builder (a function of the reward.judge settings that returns a "
                               "JudgeMode)")


class JudgeError(RuntimeError):
    """The judge gave no score for one question (the request failed, or the mode cannot read the reply)."""


def chat_url(url: str) -> str:
    """The chat-completions URL of an endpoint given as its base (`http://host:8000/v1`) or in full."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else f"{url}/chat/completions"


def fill(template: str, values: dict[str, str]) -> str:
    """`template` with each `{question}`, `{reference}`, `{answer}`, `{low}`, `{high}` it holds replaced by its
    value, in one pass (an answer holding "{reference}" stays as written); other braces are kept as written."""
    return _PLACEHOLDER.sub(lambda found: values.get(found.group(1), found.group(0)), template)


@dataclass(frozen=True)
class JudgeMode:
    """How a judge is asked and how its reply is read: `template` (the user message; `fill`'s placeholders),
    `read(reply) -> score in [0, 1]` (JudgeError for a reply it cannot read), `max_tokens` (the most tokens the
    judge writes), `values` (the template's other placeholders, e.g. the scale's low and high)."""

    name: str
    template: str
    read: Callable[[str], float]
    max_tokens: int
    values: dict[str, str] = field(default_factory=dict)

    def prompt(self, question: Question) -> str:
        asked, reference, answer = question
        return fill(self.template, {**self.values, "question": asked, "reference": reference, "answer": answer})


def read_verdict(reply: str) -> float:
    """1.0 for a reply that begins with yes (or 1), 0.0 for no (or 0); JudgeError otherwise."""
    found = _VERDICT.match(reply)
    if found is None:
        raise JudgeError(f"the judge replied {reply[:80]!r}, neither yes nor no")
    return 1.0 if found.group(1).lower() in ("yes", "1") else 0.0


@JUDGE_MODES.register("verdict")
def verdict_mode(settings=None) -> JudgeMode:
    """`reward.judge.mode=verdict`: `PROMPT` (modelled on DeepEyes'), a one-word reply, yes 1.0 / no 0.0."""
    tokens = getattr(settings, "max_tokens", None) or 4
    return JudgeMode("verdict", PROMPT, read_verdict, tokens)


def judge_mode(settings) -> JudgeMode:
    """The `JudgeMode` reward.judge.mode names, built from the settings (a plugin's result checked)."""
    mode = JUDGE_MODES.get(settings.mode)(settings)
    if not isinstance(mode, JudgeMode):
        raise UserError(f"reward.judge.mode={settings.mode} built a {type(mode).__name__}, not a JudgeMode "
                        "(gpg_vl/reward/judge.py); return one from the mode's builder.")
    return mode


def judge_prompt(question: Question) -> str:
    """The verdict mode's user message for (question, reference, answer)."""
    return verdict_mode().prompt(question)


# ---------------------------------------------------------------------------------------------
# counting what a completion's scoring asked (gpg_vl/reward/pool.py)
# ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """The judge's answers to one completion's rewards: how many were asked, how many gave no score."""

    asked: int = 0
    missing: int = 0


_TALLY = threading.local()


@contextmanager
def judge_tally() -> Iterator[Tally]:
    """Count the judge's answers to what this thread asks meanwhile (the scoring of one completion: a reward
    runs in the thread that scores its completion)."""
    tally, before = Tally(), getattr(_TALLY, "current", None)
    _TALLY.current = tally
    try:
        yield tally
    finally:
        _TALLY.current = before


# ---------------------------------------------------------------------------------------------
# the judges
# ---------------------------------------------------------------------------------------------
class Judge:
    """`judge(question, reference, answer) -> score | MISSING`, memoised; subclasses implement `decide`.

    `concurrency`: how many questions the scoring sends at once (gpg_vl/reward/pool.py); `lost`: None, or the
    `EngineUnreachable` that says the judge is down (the scoring raises it)."""

    concurrency = 1

    def __init__(self) -> None:
        self._memo: OrderedDict[Question, float] = OrderedDict()
        self._failed: dict[Question, str] = {}  # this step's failed questions (why): asked again, missing at once
        self._lock = threading.Lock()
        self.lost: Exception | None = None
        self.missing = 0  # questions that got no score (the run's record; each step's is counted by the scoring)
        self._warned = False

    def __call__(self, question: str, reference: str, answer: str) -> float:
        score = self.score((question, reference, answer))
        tally = getattr(_TALLY, "current", None)
        if tally is not None:
            tally.asked += 1
            tally.missing += math.isnan(score)
        return score

    def score(self, key: Question) -> float:
        """The score of `key` (memoised), or MISSING when the judge gives none (the reason said once)."""
        with self._lock:
            if key in self._memo:
                return self._memo[key]
            if key in self._failed:
                return MISSING
        try:
            score = self.decide(key)
        except JudgeError as error:
            with self._lock:
                self._failed[key] = str(error)
                self.missing += 1
                first, self._warned = not self._warned, True
            if first:
                print(f"warning: {str(error).rstrip('.')}; that completion's score is missing (NaN: its group is left "
                      "out of the update; counted per step as judge_missing in metrics.jsonl). Said once.",
                      file=sys.stderr)
            return MISSING
        with self._lock:
            self._memo[key] = score
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return score

    def new_step(self) -> None:
        """Forget the failed questions and a lost judge (the trainer calls this as each step starts): within a
        step, a question that failed fails again at once instead of costing the endpoint's timeout twice."""
        with self._lock:
            self._failed.clear()
            self.lost = None

    def decide(self, question: Question) -> float:
        """The score of one (question, reference, answer) not in the memo; JudgeError when there is none."""
        raise NotImplementedError


class EndpointJudge(Judge):
    """A judge behind an OpenAI-compatible endpoint (`url`: its base, e.g. http://localhost:8000/v1).

    `model`: the model name the endpoint serves; `timeout_s`: how long a request may go unanswered (retried while
    the server cannot be reached) before the judge is down; `api_key_env`: the environment variable holding a
    bearer token, sent when it is set (a local server needs none); `mode`: a `JudgeMode` (default: verdict);
    `concurrency`: the most requests in flight at once.
    """

    def __init__(self, url: str, *, model: str = "judge", timeout_s: float = 30.0,
                 api_key_env: str = "OPENAI_API_KEY", mode: JudgeMode | None = None, concurrency: int = 8) -> None:
        from gpg_vl.rollout.vllm.client import Server

        if not re.match(r"https?://[^/\s]+", str(url)):
            raise UserError(f"reward.judge.url={url!r} is not an http(s) URL; give an OpenAI-compatible endpoint "
                            "such as http://localhost:8000/v1.")
        if timeout_s <= 0:
            raise UserError(f"reward.judge.timeout_s={timeout_s} must be above 0.")
        super().__init__()
        self.url, self.model, self.timeout_s, self.api_key_env = chat_url(url), model, float(timeout_s), api_key_env
        self.mode, self.concurrency = mode or verdict_mode(), max(1, int(concurrency))
        token = os.environ.get(api_key_env)
        self.server = Server(self.url.removesuffix("/chat/completions"), timeout_s=self.timeout_s,
                             headers={"Authorization": f"Bearer {token}"} if token else None)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self.requests = 0  # requests sent (the memo answers repeats)

    def decide(self, question: Question) -> float:
        return self.mode.read(self.ask(self.mode.prompt(question)))

    def ask(self, prompt: str) -> str:
        """The endpoint's reply to one user message (greedy, at most the mode's tokens). JudgeError when the server
        refuses it or its answer holds no reply; when the server cannot be reached within timeout_s, `lost` is set
        first (then every later question fails at once)."""
        from gpg_vl.rollout.vllm.client import Rejected, ServerGone

        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": self.mode.max_tokens}
        with self._slots:
            if self.lost is not None:
                raise JudgeError(f"the judge is down ({self.lost})")
            with self._lock:
                self.requests += 1
            try:
                reply = self.server.post("/chat/completions", body, limit="reward.judge.timeout_s")
            except ServerGone as error:
                with self._lock:
                    self.lost = self.lost or ServerGone(f"the judge is down: {error}")
                raise JudgeError(str(self.lost)) from None
            except (Rejected, ValueError) as error:  # refused (4xx, 500), or an answer that is not JSON
                raise JudgeError(f"the judge at {self.url} gave no reply ({error})") from None
        try:
            return str(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError) as error:
            raise JudgeError(f"the judge at {self.url} answered without a reply ({type(error).__name__}: "
                             f"{str(reply)[:200]})") from None

    def served_model(self, named: str | None) -> str:
        """The model to ask: `named` (checked against the models the server lists, when it lists them), else the
        first it lists, else "judge". Reaching the server is checked here, before the policy loads: one sentence
        when it cannot be reached within timeout_s."""
        from gpg_vl.rollout.vllm.client import Rejected, ServerGone

        try:
            answer = self.server.get("/models", limit="reward.judge.timeout_s")
            listed = [str(m.get("id")) for m in answer.get("data") or [] if isinstance(m, dict)]
        except ServerGone as error:
            raise UserError(f"the judge at reward.judge.url cannot be reached: {error}") from None
        except (Rejected, AttributeError, ValueError):  # a server without the route (a stand-in): nothing to check
            listed = []
        if named and listed and named not in listed:
            raise UserError(f"the judge at {self.url} serves {', '.join(listed)}, not reward.judge.model={named}; "
                            f"set reward.judge.model={listed[0]}.")
        return named or (listed[0] if listed else "judge")


@JUDGES.register("none")
def no_judge(settings, device) -> None:
    """`reward.judge.kind=none`: no judge (rows that need one are skipped and counted)."""
    return None


@JUDGES.register("endpoint")
def endpoint_judge(settings, device) -> EndpointJudge:
    """`reward.judge.kind=endpoint`: `EndpointJudge` at reward.judge.url in reward.judge.mode, asking
    reward.judge.model (null: the model the server serves); the settings made sure the url is set."""
    judge = EndpointJudge(settings.url, timeout_s=settings.timeout_s, api_key_env=settings.api_key_env,
                          mode=judge_mode(settings), concurrency=settings.concurrency)
    judge.model = judge.served_model(settings.model)
    return judge
