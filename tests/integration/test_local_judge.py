"""The local judge (gpg_vl/reward/local_judge.py) on the tiny Qwen2.5-VL: its verdict is the comparison of the
next-token log-probs of "yes" and "no" after the judge prompt, computed here by hand from the model's own
logits (one prompt at a time, no padding); a rigged lm_head row of "yes" flips it; questions asked while a
forward pass runs go together in the next one."""

import threading

import pytest
import torch
from helpers.runs import tiny_family_policy

from gpg_vl.reward.judge import judge_prompt
from gpg_vl.reward.local_judge import LocalJudge

QUESTIONS = [("What is the color of the square?", "The square is blue.", "blue"),
             ("What is the color of the square?", "The square is blue.", "It is a red square, seen in the crop"),
             ("Where is the cup?", "The cup is to the left of the plate.", "left")]


@pytest.fixture(scope="module")
def judge_policy():
    return tiny_family_policy("qwen2_5_vl", None)


def by_hand(judge_policy, question):
    """(log p(yes) - log p(no), the lm_head's input) at the next token after the judge prompt, from the
    processor's chat template and the model's forward, one unpadded prompt."""
    tokenizer = judge_policy.processor.tokenizer
    text = judge_policy.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": judge_prompt(question)}]}], tokenize=False,
        add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # [1, P]
    yes, no = (tokenizer(text + word, add_special_tokens=False)["input_ids"][ids.shape[1]] for word in ("yes", "no"))
    seen = []
    hook = judge_policy.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0][0, -1]))
    try:
        with torch.no_grad():
            logps = judge_policy.model(input_ids=ids).logits[0, -1].float().log_softmax(-1)  # [V]
    finally:
        hook.remove()
    return (logps[yes] - logps[no]).item(), seen[0], yes


def test_the_verdict_is_the_yes_no_log_prob_comparison_of_the_models_own_logits(judge_policy):
    judge = LocalJudge(judge_policy)
    margins = judge.margins(QUESTIONS)  # one left-padded batch
    for question, margin in zip(QUESTIONS, margins.tolist(), strict=True):
        expected, _, yes = by_hand(judge_policy, question)
        assert judge.yes_id == yes
        assert margin == pytest.approx(expected, abs=1e-4)
        assert judge(*question) == (1.0 if expected > 0 else 0.0)
    assert judge.forwards == 3 and judge(*QUESTIONS[0]) in (0.0, 1.0) and judge.forwards == 3  # memoised


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_rigged_yes_row_of_the_lm_head_decides_the_verdict(judge_policy, sign):
    """The lm_head row of "yes" set to the row of "no" plus 5 h / |h|^2 (h: the lm_head's input at the next
    token), so log p(yes) - log p(no) = 5 sign exactly: the verdict follows the sign."""
    model, question = judge_policy.model, QUESTIONS[1]
    tied = model.lm_head.weight
    try:
        model.lm_head.weight = torch.nn.Parameter(tied.detach().clone())  # untied: the prompt's embeddings stay
        judge = LocalJudge(judge_policy)
        _, hidden, _ = by_hand(judge_policy, question)
        with torch.no_grad():
            model.lm_head.weight[judge.yes_id] = model.lm_head.weight[judge.no_id] + sign * 5 * hidden / hidden.dot(
                hidden)
        assert by_hand(judge_policy, question)[0] == pytest.approx(5 * sign, abs=1e-3)
        assert judge(*question) == (1.0 if sign > 0 else 0.0)
    finally:
        model.lm_head.weight = tied


def test_questions_asked_during_a_forward_pass_share_the_next_one(judge_policy):
    judge = LocalJudge(judge_policy, batch_size=16)
    verdicts = {}
    with judge._forward:  # a forward pass running: the questions wait in the queue
        threads = [threading.Thread(target=lambda q=q: verdicts.__setitem__(q, judge(*q))) for q in QUESTIONS]
        for thread in threads:
            thread.start()
        while len(judge._pending) < len(QUESTIONS):
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(timeout=60)
    assert judge.forwards == 1 and judge.judged == 3
    assert verdicts == {q: (1.0 if by_hand(judge_policy, q)[0] > 0 else 0.0) for q in QUESTIONS}
