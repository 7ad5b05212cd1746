"""An LLM judge as a reward: is a model's answer the same as a reference sentence?

DeepEyes' V*-style training rows have sentences as ground truth ("The bag is black."), which no rule matches;
DeepEyes asks Qwen2.5-72B, Mini-o3 GPT-4o. The judge is a run-level setting, `reward.judge.*`
(gpg_vl/config/schema.py's `JudgeSettings`), its kind picked by name from `JUDGES`:

- `none` (the default): no judge; a task whose rows need one skips them with a counted reason (never scores 0);
- `endpoint`: `EndpointJudge` asks any OpenAI-compatible chat-completions endpoint (`vllm serve`, SGLang, TGI,
  a hosted API) with a fixed prompt modelled on DeepEyes' and reads a one-word verdict. It uses the standard
  library only (urllib), so it adds no dependency. A model served by vLLM is reached this way;
- `local`: `LocalJudge` (gpg_vl/reward/local_judge.py), a model loaded through the model families on the run's
  device, which answers in one forward pass by comparing the log-probs of "yes" and "no".

A task asks for a judge with `uses_judge = True` and reads `task.judge` (None, or a `Judge`: `judge(question,
reference, answer) -> 1.0 | 0.0`); the setup (`gpg_vl/train/build.py`'s `build_judge`) sets it, in training and
in evaluation, so a task never knows where its judge comes from. Verdicts are memoised (the tool bonus asks the
accuracy of a completion again). A judge that cannot give a verdict (an unreachable endpoint, a timeout, an
unreadable reply) raises `JudgeError`: the task then scores that completion 0 for accuracy and counts it in
`reward_errors`, never silently. A failed verdict is remembered until the next step (`Judge.new_step`), so
asking it again (the tool bonus) fails at once rather than costing the endpoint's timeout twice.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections import OrderedDict

from gpg_vl.config.names import JUDGE_BUILTINS
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
MEMO_SIZE = 4096  # verdicts kept: the tool bonus asks the accuracy of a completion again

Question = tuple[str, str, str]  # (question, reference, answer)

# reward.judge.kind -> a builder `fn(settings: JudgeSettings, device) -> Judge | None` (None: no judge)
JUDGES = Registry("judge", "reward.judge.kind", JUDGE_BUILTINS,
                  expects="a judge builder (a function of the reward.judge settings and the device)")


class JudgeError(RuntimeError):
    """The judge could not give a verdict (the endpoint failed, or its reply is neither yes nor no)."""


def chat_url(url: str) -> str:
    """The chat-completions URL of an endpoint given as its base (`http://host:8000/v1`) or in full."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else f"{url}/chat/completions"


def judge_prompt(question: Question) -> str:
    """The judge's user message for (question, reference, answer)."""
    asked, reference, answer = question
    return PROMPT.format(question=asked, reference=reference, answer=answer)


class Judge:
    """`judge(question, reference, answer) -> 1.0 | 0.0`, memoised; subclasses implement `decide`."""

    def __init__(self) -> None:
        self._memo: OrderedDict[Question, float] = OrderedDict()
        self._failed: dict[Question, str] = {}  # this step's failed verdicts: asked again, they fail at once
        self._lock = threading.Lock()

    def __call__(self, question: str, reference: str, answer: str) -> float:
        key = (question, reference, answer)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
            if key in self._failed:
                raise JudgeError(self._failed[key])
        try:
            verdict = self.decide(key)
        except JudgeError as error:
            with self._lock:
                self._failed[key] = str(error)
            raise
        with self._lock:
            self._memo[key] = verdict
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return verdict

    def new_step(self) -> None:
        """Forget the failed verdicts (the trainer calls this as each step starts): within a step, a question
        whose verdict failed fails again at once instead of costing the endpoint's timeout twice."""
        with self._lock:
            self._failed.clear()

    def decide(self, question: Question) -> float:
        """The verdict on one (question, reference, answer) not in the memo; JudgeError when there is none."""
        raise NotImplementedError


class EndpointJudge(Judge):
    """A judge behind an OpenAI-compatible endpoint (`url`: its base, e.g. http://localhost:8000/v1).

    `model`: the model name the endpoint serves; `timeout_s`: per request; `api_key_env`: the environment
    variable holding a bearer token, sent when it is set (a local server needs none).
    """

    def __init__(self, url: str, *, model: str = "judge", timeout_s: float = 30.0,
                 api_key_env: str = "OPENAI_API_KEY") -> None:
        if not re.match(r"https?://[^/\s]+", str(url)):
            raise UserError(f"reward.judge.url={url!r} is not an http(s) URL; give an OpenAI-compatible endpoint "
                            "such as http://localhost:8000/v1.")
        if timeout_s <= 0:
            raise UserError(f"reward.judge.timeout_s={timeout_s} must be above 0.")
        super().__init__()
        self.url, self.model, self.timeout_s, self.api_key_env = chat_url(url), model, float(timeout_s), api_key_env
        self.requests = 0  # requests sent (the memo answers repeats)

    def decide(self, question: Question) -> float:
        return self.verdict(self.ask(judge_prompt(question)))

    def ask(self, prompt: str) -> str:
        """The endpoint's reply to one user message (greedy, a few tokens)."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0, "max_tokens": 4}).encode()
        headers = {"Content-Type": "application/json"}
        if os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with self._lock:
            self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 (http(s) only)
                reply = json.loads(response.read())
            return str(reply["choices"][0]["message"]["content"])
        except (urllib.error.URLError, TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError) as error:
            raise JudgeError(f"the judge at {self.url} gave no reply ({type(error).__name__}: {error})") from None

    @staticmethod
    def verdict(reply: str) -> float:
        """1.0 for a reply that begins with yes (or 1), 0.0 for no (or 0); JudgeError otherwise."""
        found = _VERDICT.match(reply)
        if found is None:
            raise JudgeError(f"the judge replied {reply[:80]!r}, neither yes nor no")
        return 1.0 if found.group(1).lower() in ("yes", "1") else 0.0


@JUDGES.register("none")
def no_judge(settings, device) -> None:
    """`reward.judge.kind=none`: no judge (rows that need one are skipped and counted)."""
    return None


@JUDGES.register("endpoint")
def endpoint_judge(settings, device) -> EndpointJudge:
    """`reward.judge.kind=endpoint`: `EndpointJudge` at reward.judge.url (model: the name it serves; the settings
    made sure the url is set)."""
    return EndpointJudge(settings.url, model=settings.model or "judge", timeout_s=settings.timeout_s,
                         api_key_env=settings.api_key_env)
