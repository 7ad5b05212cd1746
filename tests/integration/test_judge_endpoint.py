"""The endpoint judge (gpg_vl/reward/judge.py, judge_scale.py) against a scripted OpenAI-compatible server on the
loopback (tests/helpers/judge_endpoint.py), for the cases a real vLLM server of the tiny model cannot produce
(tests/integration/test_judge_vllm_real.py takes the whole path against one):

- good scores: "Score: 10/10", "Score: 3" and a JSON answer mapped to 0..1 exactly, through a task's scoring;
- nonsense: words without a score, a score off the scale, an HTTP 400, an answer without a reply, an answer that
  is not JSON: each a missing score (NaN, counted as judge_missing), never a 0 or a 1;
- batching and concurrency: a batch's questions asked before its rewards, `concurrency` requests held in flight at
  once (the server holds each until that many are there) and never more, a repeated question asked once;
- a timeout: a server that does not answer within reward.judge.timeout_s is down (one sentence, an
  EngineUnreachable), and the questions still queued are missing at once instead of each waiting its timeout;
- a server going down: between two batches; then in a training run once step 1 is logged, which stops at
  checkpoint-1 in one sentence, and resume=auto continues once a judge is back;
- what the setup checks before the policy loads: the served model's name, a judge that cannot be reached; the
  bearer token sent."""

import math
import threading
import time

import pytest
from helpers.judge_endpoint import ScriptedJudge

from gpg_vl.config.schema import JudgeSettings
from gpg_vl.data.task import Task
from gpg_vl.errors import UserError
from gpg_vl.reward.judge import endpoint_judge
from gpg_vl.reward.pool import score_completions
from gpg_vl.rollout.engine import EngineUnreachable

ROW = {"question": "What colour is the bag?", "answer": "The bag is black."}


class Sentences(Task):
    """A task whose accuracy is the judge's score of the completion (an empty completion scores 0 unasked)."""

    name = "judged-sentences"
    uses_judge = True

    def __init__(self) -> None:
        super().__init__()
        self.reward_functions = {"accuracy": self.accuracy, "length": lambda completion, row: 0.5}

    def judge_question(self, completion, row):
        return (row["question"], row["answer"], completion) if completion else None

    def accuracy(self, completion, row):
        return self.judge(*self.judge_question(completion, row)) if completion else 0.0


def judged_task(url: str, **settings) -> Sentences:
    task = Sentences()
    task.judge = endpoint_judge(JudgeSettings(kind="endpoint", url=url, **{"mode": "scale", **settings}), "cpu")
    return task


def accuracies(scored) -> list[float]:
    return [s["accuracy"] for s in scored.scores]


REPLIES = {"black": "Score: 10/10", "dark": '{"reason": "close, not the shade", "score": 7}', "grey": "Score: 3",
           "red": "I cannot tell.", "blue": "Score: 12", "green": (400, {"error": {"message": "prompt too long"}}),
           "white": (200, {"choices": []}), "pink": (200, b"<html>not JSON</html>")}


def test_scores_map_to_0_1_and_a_judge_without_a_score_gives_missing_never_0_or_1():
    with ScriptedJudge(lambda answer, body: REPLIES[answer]) as server:
        task = judged_task(server.url)
        answers = ["black", "dark", "grey", "red", "blue", "green", "white", "pink", ""]
        scored = score_completions(task, answers, [ROW] * len(answers), workers=2)
        got = accuracies(scored)
        assert got[:3] == pytest.approx([1.0, 0.7, 0.3], abs=1e-12) and got[8] == 0.0
        assert all(math.isnan(a) for a in got[3:8])  # nonsense, off the scale, refused, no reply, not JSON
        assert [s["length"] for s in scored.scores] == [0.5] * 9  # the other rewards are scored as ever
        assert (scored.judged, scored.judge_missing, scored.errors, scored.timeouts) == (8, 5, 0, 0)
        assert task.judge.missing == 5 and task.judge.lost is None
        body = server.bodies[0]
        assert body["model"] == "judge" and body["temperature"] == 0 and body["max_tokens"] == 32
        prompt = body["messages"][0]["content"]
        assert "Give a score from 0 to 10" in prompt and "Reference answer: The bag is black." in prompt
        assert "Question: What colour is the bag?" in prompt


def test_a_batch_is_asked_at_once_with_concurrency_requests_in_flight_and_a_repeat_asked_once():
    """Reward workers 1: without the batch asked first, one request at a time would reach the server, whose
    barrier of 4 would then never fill."""
    hold = threading.Barrier(4, timeout=30)
    with ScriptedJudge(lambda answer, body: f"Score: {len(answer)}", hold=hold) as server:
        task = judged_task(server.url, concurrency=4)
        answers = ["a", "bb", "ccc", "dddd", "e", "ff", "ggg", "hhhh", "a", "bb"]  # 8 questions, two asked twice
        scored = score_completions(task, answers, [ROW] * len(answers), workers=1)
    assert accuracies(scored) == pytest.approx([len(a) / 10 for a in answers], abs=1e-12)
    assert len(server.bodies) == 8 and server.most_in_flight == 4 and not hold.broken
    assert (scored.judged, scored.judge_missing) == (10, 0)


def test_a_judge_silent_past_its_timeout_is_down_and_the_queued_questions_do_not_wait():
    def silent(answer, body):
        time.sleep(4)
        return "Score: 5"

    with ScriptedJudge(silent) as server:
        task = judged_task(server.url, concurrency=2, timeout_s=1)
        started = time.monotonic()
        with pytest.raises(EngineUnreachable) as raised:
            score_completions(task, [f"answer {i}" for i in range(8)], [ROW] * 8, workers=2)
        took = time.monotonic() - started
    sentence = str(raised.value)
    assert sentence.startswith(f"the judge is down: the vLLM server at {server.url} did not answer POST "
                               "/chat/completions within 1 s")
    assert sentence.endswith("or raise reward.judge.timeout_s.") and "\n" not in sentence
    assert len(server.bodies) == 2 and took < 4  # the two in flight; the six queued were missing at once


def test_a_server_that_goes_down_between_batches_stops_the_scoring_in_one_sentence():
    server = ScriptedJudge(lambda answer, body: "Score: 8")
    task = judged_task(server.url, timeout_s=1)
    assert accuracies(score_completions(task, ["black"], [ROW], workers=1)) == [0.8]
    server.stop()
    task.judge.new_step()
    with pytest.raises(EngineUnreachable, match=r"the judge is down: .* within 1 s \(\d+ tries; last: .*refused"):
        score_completions(task, ["dark", "grey"], [ROW] * 2, workers=1)
    assert task.judge.lost is not None and len(server.bodies) == 1
    with pytest.raises(EngineUnreachable):  # down for the rest of the step, even for a question it has answered
        score_completions(task, ["black"], [ROW], workers=1)
    task.judge.new_step()
    assert task.judge.lost is None
    assert accuracies(score_completions(task, ["black"], [ROW], workers=1)) == [0.8]  # the memo: no request


def test_the_setup_checks_the_served_model_and_that_the_judge_can_be_reached(monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    with ScriptedJudge(lambda answer, body: "Score: 1", models=("qwen-judge", "other")) as server:
        with pytest.raises(UserError, match=r"serves qwen-judge, other, not reward.judge.model=judge; set "
                                            r"reward.judge.model=qwen-judge\.$"):
            judged_task(server.url, model="judge")
        task = judged_task(server.url, api_key_env="JUDGE_TOKEN")  # null: the model it serves
        score_completions(task, ["x"], [ROW], workers=1)
        assert server.bodies[-1]["model"] == "qwen-judge" and server.headers[-1]["Authorization"] == "Bearer s3cret"
    with pytest.raises(UserError, match=r"^the judge at reward.judge.url cannot be reached: .*raise "
                                        r"reward.judge.timeout_s\.$"):
        judged_task(server.url, timeout_s=1)


# ---------------------------------------------------------------- a training run
@pytest.fixture(scope="module")
def deepeyes_data(tmp_path_factory):
    from helpers.thinking_fixtures import deepeyes_parquet

    return deepeyes_parquet(tmp_path_factory.mktemp("deepeyes") / "train.parquet")


def deepeyes_run(data, url: str, *extra: str) -> list[str]:
    return ["task=deepeyes", "model=tiny", f"data.path={data}", "rollout.max_turns=2", "rollout.max_total_tokens=64",
            "reward.judge.kind=endpoint", f"reward.judge.url={url}", "reward.judge.mode=scale",
            "reward.judge.timeout_s=3", *extra]


@pytest.mark.parametrize(("reply", "accuracy", "nonfinite"), [("Score: 8", 0.95, None), ("no idea", None, 1.0)])
def test_evaluation_rescored_with_the_scale_judge_counts_a_missing_score(deepeyes_data, tmp_path, reply, accuracy,
                                                                           nonfinite):
    """scripts/eval.py re-scoring saved completions: four rows, the last one's sentence judged 8 of 10 (accuracy
    (1 + 1 + 1 + 0.8) / 4), or not scored (accuracy NaN, counted)."""
    import json

    from gpg_vl.cli import eval_main
    from gpg_vl.config.compose import load_config

    predictions = tmp_path / "predictions.jsonl"
    answers = ["B", "green", "1", "It is blue"]
    predictions.write_text("".join(json.dumps({"index": i, "id": f"deepeyes-train-{i}", "split": "train",
                                               "completion": f"<answer>{a}</answer>"}) + "\n"
                                   for i, a in enumerate(answers)))
    with ScriptedJudge(lambda answer, body: reply) as server:
        metrics = eval_main(load_config("eval", [
            "task=deepeyes", f"data.path={deepeyes_data}", f"predictions={predictions}", "reward.judge.kind=endpoint",
            f"reward.judge.url={server.url}", "reward.judge.mode=scale", f"output_dir={tmp_path / 'eval'}"]))
    assert len(server.bodies) == 1 and "Model's answer: It is blue" in server.bodies[0]["messages"][0]["content"]
    if accuracy is None:
        assert math.isnan(metrics["accuracy"])
    else:
        assert metrics["accuracy"] == pytest.approx(accuracy)
    assert metrics.get("rewards_nonfinite") == nonfinite


@pytest.mark.slow
def test_a_run_logs_the_judges_missing_count_and_stops_at_a_checkpoint_when_the_judge_goes_down(
        deepeyes_data, tmp_path):
    """deepeyes on its fixture (one row of four has a sentence ground truth; sampled at temperature 3, so that the
    embedded tiny model's answers differ): the scripted judge scores every
    other question it gets and calls the rest nonsense; step 1's judged and judge_missing are its completions',
    read back from its rollouts. The judge goes down once step 1 is logged, so step 2 stops the run in one
    sentence with checkpoint-1, and resume=auto continues once a judge is back."""
    import json

    from gpg_vl_tasks.deepeyes import deepeyes_answer
    from helpers.runs import train_run

    from gpg_vl.reward.judge import judge_mode

    replies: dict[str, str] = {}  # prompt -> reply

    def script(answer, body):
        prompt = body["messages"][0]["content"]
        replies.setdefault(prompt, "Score: 6" if len(replies) % 2 == 0 else "no idea")
        return replies[prompt]

    out = tmp_path / "out"
    server = ScriptedJudge(script)

    def down_after_step_1():
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            time.sleep(0.05)
        server.stop()

    threading.Thread(target=down_after_step_1, daemon=True).start()
    try:
        with pytest.raises(UserError) as raised:
            train_run(out, *deepeyes_run(deepeyes_data, server.url, "trainer.max_steps=2",
                                         "trainer.log_rollouts_groups=64", "rollout.temperature=3"))
    finally:
        server.stop()
    sentence = str(raised.value)
    assert sentence.startswith(f"the judge is down: the vLLM server at {server.url} did not answer ")
    assert "the run stopped after step 1 and wrote checkpoint-1: continue with resume=auto" in sentence
    assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-2").exists()
    step_1 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rollouts = json.loads((out / "rollouts" / "step-1.json").read_text())
    assert sum(rollouts["groups_per_attempt"]) == len(rollouts["groups"])  # every group of the step is there
    rubric = judge_mode(JudgeSettings(mode="scale"))
    asked = [(c, replies[rubric.prompt(("What is the color of the square?", "The square is blue.",
                                        deepeyes_answer(c["text"])))])
             for group in rollouts["groups"] if group["target"] == "The square is blue."
             for c in group["completions"] if deepeyes_answer(c["text"])]
    assert step_1["judged"] == len(asked) > 0 and len(replies) > 1
    assert step_1["judge_missing"] == sum(reply == "no idea" for _, reply in asked) == step_1["rewards_nonfinite"]
    print(json.dumps({k: step_1[k] for k in ("judged", "judge_missing", "rewards_nonfinite", "valid_fraction")}))
    for completion, reply in asked:  # 6 on 0..10, or missing
        assert completion["components"]["accuracy"] == (pytest.approx(0.6) if reply == "Score: 6" else "nan")
    with ScriptedJudge(lambda answer, body: "Score: 9") as back:
        train_run(out, *deepeyes_run(deepeyes_data, back.url, "trainer.max_steps=2", "resume=auto"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["judge_missing"] == 0 and m["judged"] > 0 for m in lines[1:])
