"""An LLM judge as a reward: is a model's answer the same as a reference sentence?

DeepEyes' V*-style training rows have sentences as ground truth ("The bag is black."), which no rule matches;
DeepEyes asks Qwen2.5-72B, Mini-o3 GPT-4o. `Judge` asks any OpenAI-compatible chat-completions endpoint (vLLM's
`vllm serve`, SGLang, TGI, a hosted API) with a fixed prompt modelled on DeepEyes' and reads a one-word verdict.
It uses the standard library only (urllib), so it adds no dependency.

Off by default: a task that needs it takes `judge=<endpoint URL>` as an option and, without one, skips the rows
that need it with a counted reason instead of scoring them 0. A failed request (unreachable endpoint, timeout,
an unreadable verdict) raises `JudgeError`: the task then scores that completion 0 for accuracy and counts it in
`reward_errors`, never silently.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections import OrderedDict

from gpg_vl.errors import UserError

PROMPT = """You judge whether a model's answer to a question about an image means the same as the reference answer.
The answers are consistent when they state the same fact, however it is worded: "pink" and "It is pink." are
consistent; "left" and "The cup is to the right of the plate." are not. Reply with one word: yes or no.

Question: {question}
Reference answer: {reference}
Model's answer: {answer}
Consistent:"""
_VERDICT = re.compile(r"\W*(yes|no|1|0)\b", re.IGNORECASE)
MEMO_SIZE = 4096  # verdicts kept: the tool bonus asks the accuracy of a completion again


class JudgeError(RuntimeError):
    """The judge could not give a verdict (the endpoint failed, or its reply is neither yes nor no)."""


def chat_url(url: str) -> str:
    """The chat-completions URL of an endpoint given as its base (`http://host:8000/v1`) or in full."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else f"{url}/chat/completions"


class Judge:
    """`judge(question, reference, answer) -> 1.0 | 0.0` through an OpenAI-compatible endpoint.

    `model`: the model name the endpoint serves; `timeout_s`: per request; `api_key_env`: the environment
    variable holding a bearer token, sent when it is set (a local server needs none).
    """

    def __init__(self, url: str, *, model: str = "judge", timeout_s: float = 30.0,
                 api_key_env: str = "OPENAI_API_KEY") -> None:
        if not re.match(r"https?://[^/\s]+", str(url)):
            raise UserError(f"judge {url!r} is not an http(s) URL; give an OpenAI-compatible endpoint such as "
                            "http://localhost:8000/v1.")
        if timeout_s <= 0:
            raise UserError(f"judge timeout {timeout_s} s must be above 0.")
        self.url, self.model, self.timeout_s, self.api_key_env = chat_url(url), model, float(timeout_s), api_key_env
        self._memo: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        self.requests = 0  # requests sent (the memo answers repeats)

    def __call__(self, question: str, reference: str, answer: str) -> float:
        key = (question, reference, answer)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        verdict = self.verdict(self.ask(PROMPT.format(question=question, reference=reference, answer=answer)))
        with self._lock:
            self._memo[key] = verdict
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return verdict

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
