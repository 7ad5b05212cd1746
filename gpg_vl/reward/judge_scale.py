"""`reward.judge.mode=scale`: a judge that grades on a scale, as AReno (a JSON score 0-10 mapped to 0-1) and
miles_diffusion (an API rubric 0-4) ask for.

The judge gets a rubric (`reward.judge.rubric`: a template, or a file holding one; `RUBRIC` by default) with the
question, the reference answer and the model's answer, and replies with a score on the scale the settings declare
(`reward.judge.scale_min` .. `scale_max`, 0..10 by default). `parse_score` reads it and maps it to 0..1:
`(score - scale_min) / (scale_max - scale_min)`. What it reads, first found wins:

1. JSON: the last `{...}` in the reply that parses to an object with a `score` key (any case), a number or a
   number written as a string (`{"score": 7}`, `{"reason": "...", "score": "6.5"}`, inside a code fence or not);
2. a labelled score: the last `Score: N` (`score = N`, `**Score:** N`, `the score is N`), optionally `N/M` or
   `N out of M`;
3. a reply that is one number and nothing else (`7`, `7/10`, `**7**`).

A reply without any of these (words only, or several numbers none of them labelled), a score outside the scale
(not clipped: an 11 on 0..10 is nonsense, not a 10), and `N/M` with M other than scale_max (the judge used
another scale) give no score: `JudgeError`, which the judge turns into a missing score (gpg_vl/reward/judge.py).
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

from gpg_vl.errors import UserError
from gpg_vl.reward.judge import JUDGE_MODES, JudgeError, JudgeMode

RUBRIC = """You grade a model's answer to a question about an image against the reference answer.
Give a score from {low} to {high}: {high} when the answer states the same facts as the reference, {low} when it
contradicts the reference or answers something else, and a score in between for an answer that is partly right or
incomplete. Judge the meaning, not the wording.

Question: {question}
Reference answer: {reference}
Model's answer: {answer}

Reply with the score alone, written as "Score: N"."""
MAX_TOKENS = 32  # "Score: 7" and a little room; a rubric that asks for reasons first needs reward.judge.max_tokens
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_OUT_OF = rf"(?:\s*(?:/|out\s+of)\s*({_NUMBER}))?"
_LABELLED = re.compile(rf"\bscore\b(?:\s+is)?[\s*_:=]*({_NUMBER}){_OUT_OF}", re.IGNORECASE)
_ALONE = re.compile(rf"[\s*_\"'(\[]*({_NUMBER}){_OUT_OF}[\s*_\"')\].]*", re.IGNORECASE)
_OBJECT = re.compile(r"\{[^{}]*\}")


def number(value: float) -> str:
    """A scale bound as the rubric shows it: 10, not 10.0."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def json_score(reply: str) -> float | None:
    """The `score` of the last JSON object in `reply` that has one; None when none has."""
    for text in reversed(_OBJECT.findall(reply)):
        try:
            found = json.loads(text)
        except ValueError:
            continue
        value = next((v for k, v in found.items() if str(k).lower() == "score"), None) \
            if isinstance(found, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise JudgeError(f"the judge's JSON score {value!r} is not a number")
        try:
            return float(value)
        except ValueError:
            raise JudgeError(f"the judge's JSON score {value!r} is not a number") from None
    return None


def raw_score(reply: str, high: float) -> float:
    """The number the judge gave, on its own scale (see the module doc); JudgeError when there is none."""
    value = json_score(reply)
    if value is not None:
        return value
    labelled = _LABELLED.findall(reply)
    alone = _ALONE.fullmatch(reply.strip())
    if labelled:
        value, out_of = labelled[-1]
    elif alone:
        value, out_of = alone.group(1), alone.group(2)
    else:
        many = len(re.findall(_NUMBER, reply)) > 1
        raise JudgeError(f"the judge replied {reply[:80]!r}, which holds "
                         f"{'several numbers and no Score: label' if many else 'no score'}")
    if out_of and float(out_of) != high:
        raise JudgeError(f"the judge scored {value} out of {out_of}, not out of reward.judge.scale_max={number(high)}")
    return float(value)


def parse_score(reply: str, low: float, high: float) -> float:
    """The judge's score in `reply` on the scale low..high, mapped to 0..1; JudgeError for no score, or one off
    the scale."""
    value = raw_score(reply, high)
    if not low <= value <= high:
        raise JudgeError(f"the judge's score {value:g} is outside reward.judge.scale_min..scale_max "
                         f"({number(low)}..{number(high)})")
    return (value - low) / (high - low)


def rubric_template(rubric: str | None) -> str:
    """reward.judge.rubric as a template: itself when it holds `{answer}`, else the text of the file it names;
    RUBRIC when unset. One sentence for a file that does not exist or a template without `{answer}`."""
    if rubric is None:
        return RUBRIC
    if "{answer}" in rubric:
        return rubric
    path = Path(rubric).expanduser()
    if not path.is_file():
        raise UserError(f"reward.judge.rubric={rubric[:80]!r} is neither a template holding {{answer}} nor an "
                        "existing file; give the rubric's text (with {question}, {reference}, {answer}) or a path "
                        "to a text file holding it.")
    text = path.read_text(errors="replace")
    if "{answer}" not in text:
        raise UserError(f"the rubric in {path} (reward.judge.rubric) holds no {{answer}}, so the judge would never "
                        "see the model's answer; add {answer} (and {question}, {reference}) where they go.")
    return text


@JUDGE_MODES.register("scale")
def scale_mode(settings) -> JudgeMode:
    """`reward.judge.mode=scale`: the rubric (reward.judge.rubric) on scale_min..scale_max, its score mapped to
    0..1 by `parse_score`."""
    low, high = float(settings.scale_min), float(settings.scale_max)
    return JudgeMode("scale", rubric_template(settings.rubric), partial(parse_score, low=low, high=high),
                     settings.max_tokens or MAX_TOKENS, {"low": number(low), "high": number(high)})
