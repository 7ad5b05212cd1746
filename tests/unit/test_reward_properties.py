"""Property tests: every built-in reward and every task's reward functions never raise and stay in range, on
arbitrary unicode, megabyte strings and nested or broken tags; math equivalence is bounded in time; a reward that
raises scores 0 (counted, traceback once) and a NaN/inf reward makes its group invalid (reported)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpg_vl import get_task
from gpg_vl.reward import math_check
from gpg_vl.reward.pool import score_completions
from gpg_vl.reward.primitives import (
    box_giou,
    box_iou,
    choice_letter,
    choice_reward,
    exact_match_reward,
    extract_answer,
    format_reward,
    giou_reward,
    iou_reward,
    label_reward,
    math_reward,
    parse_box,
)

FRAGMENTS = st.sampled_from([
    "<answer>", "</answer>", "<think>", "</think>", "<answer", "answer>", "</", "<", ">", "/", "[", "]", "{", "}",
    ",", "(", ")", "0", "10", "1.5", "-3", "1e309", "nan", "inf", "\\frac{1}{2}", "^", "{\\circ}", "$", "°", "B",
    "(B)", "red", "rose", " ", "\n", "\t", '"bbox_2d":', "```json", "```", "\x00", "\ud7ff", "\U0001f600", "\u202e",
    "\u0301", "\u4e2d", "\x85", "\u2028"])
UNIT = st.lists(st.one_of(FRAGMENTS, st.text(max_size=4)), min_size=1, max_size=30).map("".join).filter(bool)
NESTED = st.recursive(
    st.one_of(FRAGMENTS, st.text(max_size=8)),
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(["answer", "think"]), inner, st.booleans(), st.booleans()).map(
            lambda t: (f"<{t[0]}>" if t[2] else "") + t[1] + (f"</{t[0]}>" if t[3] else "")),
        st.lists(inner, max_size=4).map("".join)),
    max_leaves=25)
MEGABYTE = st.tuples(UNIT, st.text(max_size=20)).map(lambda t: (t[0] * (1_000_000 // len(t[0]) + 1))[:1_000_000]
                                                     + t[1])
COMPLETIONS = st.one_of(st.text(), NESTED, MEGABYTE)
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6))
BOXES = st.one_of(st.lists(NUMBER, min_size=4, max_size=4), st.tuples(NUMBER, NUMBER, NUMBER, NUMBER))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


def in_range(value, low, high, discrete=False):
    assert isinstance(value, float) and math.isfinite(value) and low <= value <= high, value
    assert not discrete or value in (0.0, 1.0), value


@FAST
@given(COMPLETIONS, st.text(max_size=30), st.lists(st.text(max_size=20), max_size=5), st.text(max_size=20))
def test_text_rewards_never_raise_and_stay_in_range(completion, target, labels, answer):
    in_range(format_reward(completion), 0, 1, discrete=True)
    in_range(exact_match_reward(completion, target), 0, 1, discrete=True)
    in_range(label_reward(completion, labels), 0, 1, discrete=True)
    in_range(label_reward(completion, target), 0, 1, discrete=True)
    in_range(choice_reward(completion, labels, answer), 0, 1, discrete=True)
    assert choice_letter(completion, labels) in (None, *"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    found = extract_answer(completion)
    assert found is None or found in completion


@FAST
@given(COMPLETIONS, BOXES)
def test_box_rewards_never_raise_and_stay_in_range(completion, target):
    in_range(iou_reward(completion, target), 0, 1)
    in_range(giou_reward(completion, target), 0, 2)
    box = parse_box(completion)
    assert box is None or (len(box) == 4 and all(math.isfinite(v) for v in box) and box[2] > box[0])
    in_range(box_iou(target, target), 0, 1)
    in_range(box_giou(target, (0, 0, 1, 1)), -1, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(COMPLETIONS, st.one_of(st.text(max_size=12), st.sampled_from(["140", "\\frac{1}{2}", "3^{2}", "0.5"])))
def test_math_reward_never_raises_and_stays_in_range(completion, truth):
    in_range(math_reward(completion, truth, timeout_s=0.5), 0, 1, discrete=True)


def task_cases():
    """(task, a strategy of the rows its reward functions read, each reward's (low, high, only 0 or 1))."""
    text = st.text(max_size=20)
    binary = (0.0, 1.0, True)
    boxes = st.fixed_dictionaries({"box": st.one_of(st.none(), BOXES)})
    return [
        (get_task("shapes", train_size=1, test_size=1), st.fixed_dictionaries({"answer": text}), {}),
        (get_task("cvbench", train_limit=1),
         st.fixed_dictionaries({"choices": st.lists(text, max_size=5), "answer": text}), {}),
        (get_task("geoqa"), st.fixed_dictionaries({"answer": st.text(max_size=10)}), {}),
        (get_task("classification"), st.fixed_dictionaries({"labels": st.lists(text, max_size=4)}), {}),
        (get_task("lisa"), boxes, {"accuracy": (0.0, 1.0, False)}),
        (get_task("lisa", reward="giou"), boxes, {"accuracy": (0.0, 2.0, False)}),
    ], binary


CASES, BINARY = task_cases()


@pytest.mark.parametrize("task,rows,ranges", CASES, ids=[f"{t.name}-{i}" for i, (t, _, _) in enumerate(CASES)])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(completion=COMPLETIONS, data=st.data())
def test_every_task_reward_function_never_raises_and_stays_in_range(task, rows, ranges, completion, data):
    row = data.draw(rows)
    for name, fn in task.reward_functions.items():  # the raw functions: nothing catches their errors here
        in_range(float(fn(completion, row)), *ranges.get(name, BINARY))


def test_math_equivalence_is_bounded_in_time_by_killing_the_check():
    kills = []
    kill = math_check._MathProcess.kill

    def counted(self):
        kills.append(self)
        kill(self)

    math_check._MathProcess.kill = counted
    try:
        assert math_reward("<answer>1</answer>", "2") == 0.0  # a checking process is up and answering
        assert not kills
        # sympy sums 1000 powers with up to 3000 digits exactly: far longer than the bound, so it is killed
        assert math_reward("<answer>\\sum_{k=1}^{1000} k^{k}</answer>", "3", timeout_s=0.5) == 0.0
        assert len(kills) == 1
        assert math_reward("<answer>\\frac{1}{2}</answer>", "0.5") == 1.0  # the replacement answers
        assert len(kills) == 1
    finally:
        math_check._MathProcess.kill = kill


def test_a_reward_that_raises_scores_zero_is_counted_and_its_first_traceback_shown_once(capsys):
    task = get_task("shapes", train_size=1, test_size=1)
    task.reward_functions["mine"] = lambda completion, row: 1.0 / len(completion.strip())
    scores = [task.reward_components(text, {"answer": "red"}) for text in ("", " ", "ok")]
    assert [s["mine"] for s in scores] == [0.0, 0.0, 0.5] and task.reward_errors == {"mine": 2}
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "reward 'mine' of task 'shapes' raised" in err
    assert "ZeroDivisionError" in err
    # the trainer's scoring returns its own count, whatever the task counted before
    scored = score_completions(task, ["", "ok", " ", "no"], [{"answer": "red"}] * 4, workers=2)
    assert (scored.errors, scored.timeouts) == (2, 0) and [s["mine"] for s in scored.scores] == [0.0, 0.5, 0.0, 0.5]
    assert task.scored_components("", {"answer": "red"})[1] == 1
    assert task.scored_components("a", {"answer": "red"})[1] == 0



@pytest.mark.parametrize("value", ["1.0", None, [1.0], b"1"])
def test_a_reward_that_returns_no_number_scores_zero_and_says_what_it_returned(capsys, value):
    import numpy as np
    import torch

    task = get_task("shapes", train_size=1, test_size=1)
    task.reward_functions["mine"] = lambda completion, row: value
    assert task.reward_components("x", {"answer": "red"})["mine"] == 0.0  # never parsed: "1.0" is not 1.0
    assert task.reward_components("y", {"answer": "red"})["mine"] == 0.0 and task.reward_errors == {"mine": 2}
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "Traceback" not in err
    assert f"reward 'mine' of task 'shapes' returned {value!r} (a {type(value).__name__}), not a number" in err
    for number in (True, 1, np.float32(0.5), torch.tensor(0.25)):  # numbers of any kind are taken as they are
        task.reward_functions["mine"] = lambda completion, row, n=number: n
        assert task.reward_components("z", {"answer": "red"})["mine"] == float(number)

def test_nan_and_infinite_rewards_make_their_group_invalid_and_are_reported(policy):
    from accelerate import Accelerator

    from gpg_vl.config.schema import RolloutSettings, TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.loop import step_metrics
    from gpg_vl.train.step.sample import Collected, sample_attempt

    task = get_task("shapes", train_size=50, test_size=1)
    stream = PromptStream(task.load("train"), seed=0)
    first = stream._order[0]
    task.reward_functions["odd"] = lambda completion, row: math.nan if row["id"].endswith(f"-{first}") else (
        math.inf if "x" in completion else len(completion) % 2)
    torch.manual_seed(0)
    rollout = RolloutSettings(max_new_tokens=12)
    attempt = sample_attempt(policy, task, stream, engine=build_engine(rollout, policy), rollout=rollout,
                             trainer=TrainerSettings(batch_size=3, group_size=4, reward_workers=1), warn=print)
    finite = torch.isfinite(attempt.rewards).all(dim=1)
    assert not finite[0] and not attempt.valid[0] and task.reward_nonfinite["odd"] >= 4
    assert not (attempt.valid & ~finite).any()  # no group holding a NaN or inf reward goes into the update
    metrics = step_metrics(Collected(attempts=[attempt]), Accelerator(cpu=True), list(task.reward_functions))
    assert metrics["rewards_nonfinite"] == int((~torch.isfinite(attempt.rewards)).sum()) >= 4
    assert math.isfinite(metrics["reward_mean"]) and json.loads(json.dumps(metrics)) == metrics


def test_a_run_goes_on_when_a_users_reward_raises(tmp_path, capsys, policy):
    from gpg_vl.config.schema import RolloutSettings, TrainerSettings
    from gpg_vl.train.loop import RunSettings, setup_policy, train

    task = get_task("shapes", train_size=100, test_size=1)
    task.reward_functions["mine"] = lambda completion, row: {"a completion never says just this": 1.0}[completion]
    trainer = TrainerSettings(max_steps=2, group_size=4, batch_size=2, beta_th=0, eval_before=False, eval_after=False)
    train(setup_policy(policy, task, RunSettings(trainer, RolloutSettings(max_new_tokens=12), output_dir=tmp_path)))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and sum(m["reward_errors"] for m in lines) == 16
    assert json.loads((tmp_path / "summary.json").read_text())["reward_errors"] == 16
    assert capsys.readouterr().err.count("Traceback") == 1
