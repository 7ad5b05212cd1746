"""The new tasks scored as each benchmark's published code scores them: one test per case where gpg-vl used to
disagree (issue 36), each with the example that showed it. The expected values are what the reference computes
(Video-R1 `src/r1-v/src/open_r1/grpo.py`, DeepEyes `verl/utils/reward_score/vl_agent.py`, VSI-Bench
`lmms_eval/tasks/vsibench/utils.py`, HR-Bench `vlmeval/dataset/utils/hrbench.py`), worked out by hand from it."""

import pytest
from gpg_vl_tasks.deepeyes import DeepEyes
from gpg_vl_tasks.hrbench import HRBench
from gpg_vl_tasks.videor1 import VideoR1, multiple_choice_reward, numerical_reward, ocr_reward
from gpg_vl_tasks.vsibench import na_reward

from gpg_vl.reward.tooluse import deepeyes_answer, deepeyes_rewards, tool_format_reward

OPTIONS = ["A. dog", "B. cat", "C. bird"]
CROP = '</tool_call>\nuser\n<tool_response>\n\n</tool_response>\nassistant\n'  # a crop the trajectory received
CALL = '<think>small</think><tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 40, 50]}}'


# ---------------------------------------------------------------- Video-R1
def test_videor1_ocr_splits_words_on_any_whitespace_as_str_split():
    # Video-R1's wer: reference.split() / hypothesis.split(): 'Hello\nWorld' is the two words of 'Hello World'
    assert ocr_reward("<answer>Hello\nWorld</answer>", "Hello World") == 1.0
    assert ocr_reward("<answer>Hello\t World\n</answer>", "Hello  World") == 1.0
    # one substitution in two words: WER 1/2
    assert ocr_reward("<answer>Hello\nthere</answer>", "Hello World") == 0.5


def test_videor1_reads_the_first_answer():
    # re.search(r'<answer>\s*(.*?)\s*</answer>') finds the first pair: B, not C
    completion = "<think>x</think><answer>B</answer> no wait <answer>C</answer>"
    assert multiple_choice_reward(completion, "B", OPTIONS) == 1.0
    assert multiple_choice_reward(completion, "C", OPTIONS) == 0.0
    assert numerical_reward("<answer>3</answer> or <answer>4</answer>", "3") == 1.0
    assert numerical_reward("<answer>3</answer> or <answer>4</answer>", "4") == 0.0


def test_videor1_format_matches_the_completion_as_it_is():
    task = VideoR1()
    row = {"problem_id": 1, "problem_type": "numerical", "solution": "<answer>3</answer>", "options": []}
    assert task.reward_components("<think>x</think><answer>3</answer>", row)["format"] == 1.0
    # re.fullmatch on the content unstripped: a leading space or newline, or a trailing one, fails
    for padded in (" <think>x</think><answer>3</answer>", "\n<think>x</think><answer>3</answer>",
                   "<think>x</think><answer>3</answer>\n"):
        assert task.reward_components(padded, row)["format"] == 0.0


# ---------------------------------------------------------------- DeepEyes
def _deepeyes_reward(completion, accuracy=1.0):
    functions, weights = deepeyes_rewards(lambda completion, row: accuracy,
                                          {"accuracy": 0.8, "format": 0.2, "tool": 1.2})
    return sum(weights[name] * function(completion, {}) for name, function in functions.items())


def test_deepeyes_format_never_checks_tool_call_tags():
    # DeepEyes counts <think>, vision tokens and <answer> (after the last </think>): never <tool_call>
    unclosed = "<think>x</think><tool_call>{}<answer>B</answer>"
    stray = "<think>x</think></tool_call><answer>B</answer>"
    for completion in (unclosed, stray):
        assert tool_format_reward(completion) == 0.0
        assert _deepeyes_reward(completion) == pytest.approx(0.8)  # 0.8 acc + 0.2 x 0, no crop
    with_crop = f"{CALL}{CROP}<think>y</think></tool_call><answer>B</answer>"
    assert _deepeyes_reward(with_crop) == pytest.approx(2.0)  # 0.8 + 0 + 1.2 (crop and right)


def test_deepeyes_judges_the_text_after_the_last_answer_tag_closed_or_not():
    # answer_text = predict_str.split("<answer>")[-1].split("</answer>")[0].strip()
    assert deepeyes_answer("<think>x</think><answer>B") == "B"
    assert deepeyes_answer("<answer>A</answer> then <answer> C </answer> tail") == "C"
    task = DeepEyes()
    row = {"answer": "B", "answer_kind": "letter", "choices": ["red", "blue"]}
    assert task.accuracy("<think>x</think><answer>B", row) == 1.0
    assert tool_format_reward("<think>x</think><answer>B") == -1.0  # unbalanced <answer>: a format error, as DeepEyes
    short = {"answer": "7", "answer_kind": "short", "choices": []}
    assert task.accuracy("<think>x</think><answer> 7", short) == 1.0


def test_deepeyes_long_reply_without_an_answer_costs_the_format_reward():
    # no <answer>: the whole reply is the answer text; 1,000 characters or more -> format error, accuracy 0
    reply = "<think>" + "x" * 1000 + "</think>"
    assert tool_format_reward(reply) == -1.0
    assert _deepeyes_reward(reply, accuracy=0.0) == pytest.approx(-0.2)
    assert tool_format_reward("<think>" + "x" * 900 + "</think>") == 0.0  # under 1,000 characters
    task = DeepEyes()
    row = {"answer": "B", "answer_kind": "letter", "choices": ["red", "blue"]}
    assert task.accuracy("<answer>B" + " " * 1000 + "x</answer>", row) == 0.0  # a long answer scores no accuracy


# ---------------------------------------------------------------- VSI-Bench
def test_vsibench_reads_numbers_with_pythons_float_alone():
    # to_float(fuzzy_matching(pred)) = float('1,000') fails -> the worst case, 0
    assert na_reward("<answer>1,000</answer>", "1000") == 0.0
    assert na_reward("<answer>1000</answer>", "1000") == 1.0
    assert na_reward("<answer>1000.</answer>", "1000") == 1.0  # fuzzy_matching drops a trailing '.'
    assert na_reward("<answer>1_000</answer>", "1000") == 1.0  # float() itself reads an underscore


# ---------------------------------------------------------------- HR-Bench
def test_hrbench_average_is_over_all_rows_of_each_cycle():
    # report_acc_hrbench: per cycle, 'all' = the mean over every row; 'Average / all' = its mean over the cycles.
    # One cycle, 3 single rows right and 1 cross row wrong: all = 3/4, while (single + cross) / 2 = 1/2.
    task = HRBench()
    rows = [{"category": category, "cycle_category": "cycle1", "A": "p", "B": "q", "answer": "A", "question": "?"}
            for category in ("single", "single", "single", "cross")]
    completions = ["<answer>A</answer>"] * 3 + ["<answer>B</answer>"]
    metrics = task.metrics(rows, completions)
    assert (metrics["single"], metrics["cross"]) == (1.0, 0.0)
    assert metrics["average"] == pytest.approx(3 / 4)
