"""Rewards of tool-using ("thinking with images") tasks: lettered options in a question's text, the crops a
trajectory received, DeepEyes' format check and its tool bonus.

A multi-turn completion is the whole trajectory decoded: the model's segments and the observations the engine
appended, special tokens dropped (so an observation's images leave no text). Each model segment that calls a
tool ends at `</tool_call>` (the stop string), and the engine writes the observation right after it, wrapped in
`<tool_response>` ... `</tool_response>` (a user turn, or the template's `tool` turn); a call the tool refused
comes back as `Error: ...`. So a crop the model received is a `<tool_response>` block that directly follows a
`</tool_call>` (only the chat template's role words between) and does not hold an error. Text the model writes
itself cannot follow its own `</tool_call>` (its segment ends there), so it cannot fake a crop. In a run the
rewards also receive the trajectory itself (`Task.reward_components`' `trajectory`), and the tool bonus reads the
calls from it (`crops_received`); the text search serves completions known by their text alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from gpg_vl.config.names import TOOL_REWARD_BUILTINS
from gpg_vl.registry import Registry

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# one option line of a question's text: "(A) a red bag", "A. a red bag", "A) ..."
_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[).]\s*(.*?)\s*$")
# an observation: `</tool_call>`, the template's role words (no tag), then the `<tool_response>` block
_OBSERVATION = re.compile(r"</tool_call>[^<]{0,64}<tool_response>(.*?)</tool_response>", re.DOTALL)
MAX_ANSWER_CHARS = 1000  # DeepEyes: an answer this long or longer is a format error (and scores no accuracy)


def lettered_options(text: str) -> tuple[str, list[str]]:
    """(the text before the options, the options' texts): the trailing run of lines "(A) ...", "(B) ..." in
    order from A; ([text], []) when the text has no such lines. Lines after the options are dropped."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        found = _OPTION_LINE.match(line)
        if found and found.group(1) == "A":
            options = []
            for later in lines[start:]:
                option = _OPTION_LINE.match(later)
                if not option or option.group(1) != LETTERS[len(options)]:
                    break
                options.append(option.group(2))
            if len(options) >= 2:
                return "\n".join(lines[:start]).rstrip(), options
    return text.rstrip(), []


def options_text(options: Sequence[str]) -> str:
    """The options as lines "(A) ...", "(B) ..."."""
    return "\n".join(f"({LETTERS[i]}) {option}" for i, option in enumerate(options))


def shuffled(options: Sequence[str], label: str, key: str) -> tuple[list[str], str]:
    """(the options in an order drawn from `key` alone, the label's letter in that order): the same `key`
    (seed and question id) gives the same order on every run and machine."""
    order = list(range(len(options)))
    random.Random(key).shuffle(order)
    return [options[i] for i in order], LETTERS[order.index(LETTERS.index(label))]


def crops_used(completion: str) -> int:
    """Successful tool observations in a decoded trajectory: `<tool_response>` blocks that follow a
    `</tool_call>` and do not begin with `Error` (see the module doc); 0 for a single-turn completion. For a
    completion known by its text alone (a re-scored predictions file); a run reads `crops_received`."""
    return sum(not block.strip().startswith("Error") for block in _OBSERVATION.findall(completion))


def crops_received(trajectory) -> int:
    """The images the model received from its tool calls, read from the Trajectory's call records: the calls
    answered with an observation (the first `len(observations)`: a call cut by a limit gets none) that were no
    error and returned an image."""
    answered = trajectory.calls[:len(trajectory.observations)]
    return sum(not call.error and call.images > 0 for call in answered)


def final_segment(completion: str) -> str:
    """The text after the last observation (the model's last segment), the whole completion when there is none."""
    end = completion.rfind("</tool_response>")
    return completion if end < 0 else completion[end + len("</tool_response>"):]


def deepeyes_answer(completion: str) -> str:
    """The answer text DeepEyes' reward reads: what follows the LAST `<answer>` up to the first `</answer>` after it
    (to the end when none closes it), stripped; the whole completion when it has no `<answer>` at all.

    So `<think>..</think><answer>B` reads 'B', and a reply without tags reads as its whole text."""
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


def tool_format_reward(completion: str) -> float:
    """DeepEyes' format reward: -1.0 when the `<think>` tags or (after the last `</think>`) the `<answer>` tags are
    unbalanced, or the answer text (`deepeyes_answer`: the whole reply when it has no `<answer>`) has
    `MAX_ANSWER_CHARS` or more; else 0.0.

    As DeepEyes, `<tool_call>` tags are not checked (its third check, the balance of the vision tokens an
    observation inserts, holds by construction: the engine writes each observation whole)."""
    pairs = [("<think>", "</think>", completion), ("<answer>", "</answer>", completion.split("</think>")[-1])]
    if any(text.count(open_tag) != text.count(close_tag) for open_tag, close_tag, text in pairs):
        return -1.0
    return -1.0 if len(deepeyes_answer(completion)) >= MAX_ANSWER_CHARS else 0.0


def tool_bonus(completion: str, accuracy: float, trajectory=None) -> float:
    """DeepEyes' tool reward: 1.0 when the trajectory received at least one crop (`crops_received` of its
    `trajectory`; `crops_used` of its text when only the text is known) AND the answer is right (`accuracy`
    > 0.5), else 0.0."""
    crops = crops_received(trajectory) if trajectory is not None else crops_used(completion)
    return 1.0 if accuracy > 0.5 and crops > 0 else 0.0


# ---------------------------------------------------------------- reward sets, picked by name
# A reward set turns a task's accuracy rule `accuracy(completion, row) -> float` and the weights given in the
# task's options into (reward functions, their weights): what `Task.reward_functions` / `reward_weights` hold.
TOOL_REWARDS = Registry("tool-use reward set", "task.options.rewards", builtins=TOOL_REWARD_BUILTINS)


@TOOL_REWARDS.register("deepeyes")
def deepeyes_rewards(accuracy, weights: dict[str, float]) -> tuple[dict, dict[str, float]]:
    """DeepEyes: `accuracy` (the rule or the judge), `format` (`tool_format_reward`: 0 or -1) and `tool`
    (`tool_bonus`), weighted 0.8 / 0.2 / 1.2 by default."""
    functions = {
        "accuracy": accuracy,
        "format": lambda completion, row: tool_format_reward(completion),
        "tool": lambda completion, row, trajectory=None: tool_bonus(completion, accuracy(completion, row), trajectory),
    }
    return functions, {name: float(weights[name]) for name in functions}


@TOOL_REWARDS.register("accuracy")
def accuracy_rewards(accuracy, weights: dict[str, float]) -> tuple[dict, dict[str, float]]:
    """Mini-o3: accuracy alone (its weight `accuracy`); format and tool use earn nothing."""
    return {"accuracy": accuracy}, {"accuracy": float(weights["accuracy"])}
