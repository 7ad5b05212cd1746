"""GeoQA's answer forms: every published form of the test set's `ground_truth` equals itself, its LaTeX and plain-text
spellings and the same value with or without its unit, and never its bare coefficient or another value.

Scored through the task's API on a published GeoQA test row (`image_path`, `question`, `ground_truth`), so this is
the training reward and the metric alike; `math_text` is checked directly for what it must not touch.
"""

import pytest

from gpg_vl import get_task
from gpg_vl.reward.primitives import math_reward, math_text

# published form -> (equal spellings, different values). Each form is one of those the 754 GeoQA test answers use.
FORMS = {
    # √ with braces
    "2√{3}": (["2√{3}", "2\\sqrt{3}", "2sqrt(3)", "2*sqrt(3)", "2√3", "2 \\sqrt{3}"],
              ["2", "3", "2\\sqrt{2}", "\\sqrt{3}"]),
    "√{3}": (["\\sqrt{3}", "sqrt(3)", "√3", "√(3)"], ["3", "1"]),
    "\\frac{1}{2}√{3}": (["\\frac{\\sqrt{3}}{2}", "sqrt(3)/2", "√3/2"], ["\\frac{1}{2}", "\\frac{\\sqrt{2}}{2}"]),
    "\\frac{2√{3}}{3}": (["\\frac{2\\sqrt{3}}{3}", "2*sqrt(3)/3", "2√3/3"], ["\\frac{2}{3}", "2\\sqrt{3}", "2"]),
    "2√{3}-2": (["2\\sqrt{3}-2", "2*sqrt(3)-2", "2√3-2", "2(\\sqrt{3}-1)"], ["2\\sqrt{3}", "2", "-2"]),
    "(√{3}+1)": (["\\sqrt{3}+1", "(sqrt(3)+1)", "1+√3"], ["\\sqrt{3}", "1", "4"]),
    # π
    "4π": (["4\\pi", "4pi", "4 * pi", "4π", "4*\\pi", "4\\pi cm"], ["4", "\\pi", "8\\pi"]),
    "\\frac{4}{3}π": (["\\frac{4}{3}\\pi", "4\\pi/3", "4pi/3", "\\frac{4\\pi}{3}"], ["\\frac{4}{3}", "4\\pi", "4"]),
    # units after the number
    "5cm": (["5", "5cm", "5 cm", "5\\text{cm}", "5\\,\\mathrm{cm}"], ["6", "5.5", "50"]),
    "12m": (["12", "12 m", "12\\text{m}"], ["1", "2", "13"]),
    "8mm": (["8", "8 mm", "8mm"], ["88", "9"]),
    "10米": (["10", "10 米"], ["100", "1"]),
    "3厘米": (["3", "3cm"], ["30", "4"]),
    "2海里": (["2"], ["20", "3"]),
    "6平方米": (["6", "6m^{2}"], ["36", "5"]),
    "5秒": (["5"], ["50", "6"]),
    "2小时": (["2"], ["12", "3"]),
    "4cm²": (["4", "4cm^{2}", "4 cm^2"], ["2", "16"]),
    "27cm^{2}": (["27", "27cm²", "27 \\text{cm}^2"], ["9", "28"]),
    "8cm^2^": (["8", "8cm^{2}"], ["64", "2"]),
    # combinations
    "2√{3}cm": (["2\\sqrt{3}", "2√3 cm", "2*sqrt(3)"], ["2", "2cm", "3"]),
    "4πcm^{2}": (["4\\pi", "4pi", "4π cm^2"], ["4", "4cm^{2}", "16\\pi"]),
    "2√{3}-2cm": (["2\\sqrt{3}-2", "2√3-2"], ["2\\sqrt{3}", "2"]),
    # degrees, as before
    "140°": (["140", "140^\\circ", "140^{\\circ}", "140度"], ["40", "14"]),
}


def said(text):
    return f"<think> working </think><answer>{text}</answer>"


@pytest.fixture(scope="module")
def geoqa():
    return get_task("geoqa")


def published_row(truth):
    return {"image_path": "./Geo170K/images/test/0.png", "question": "Find x.", "ground_truth": truth}


@pytest.mark.parametrize("truth", FORMS)
def test_each_published_form_equals_its_spellings(geoqa, truth):
    row = published_row(truth)
    for spelling in [truth, *FORMS[truth][0]]:
        assert geoqa.reward_components(said(spelling), row)["accuracy"] == 1.0, spelling
    # and the other way round: a spelling as the ground truth, the published form as the answer
    assert geoqa.reward_components(said(truth), published_row(FORMS[truth][0][0]))["accuracy"] == 1.0


@pytest.mark.parametrize("truth", FORMS)
def test_each_published_form_differs_from_its_coefficient_and_other_values(geoqa, truth):
    row = published_row(truth)
    for wrong in FORMS[truth][1]:
        assert geoqa.reward_components(said(wrong), row)["accuracy"] == 0.0, wrong


def test_the_issues_three_misreadings_are_fixed(geoqa):
    assert geoqa.reward(said("2\\sqrt{3}"), published_row("2√{3}")) == 2.0  # scored 1 (format only) before
    assert geoqa.reward(said("2"), published_row("2√{3}")) == 1.0  # scored 2 before: 2√{3} was read as 2
    assert geoqa.reward(said("4\\pi"), published_row("4πcm")) == 2.0
    assert geoqa.reward(said("27"), published_row("27cm^{2}")) == 2.0


@pytest.mark.parametrize("text,latex", [
    ("2√{3}", "2\\sqrt{3}"), ("√{√{3}}", "\\sqrt{\\sqrt{3}}"), ("\\frac{2√{3}}{3}", "\\frac{2\\sqrt{3}}{3}"),
    ("√(3)", "\\sqrt{3}"), ("4π", "4\\pi"), ("\\frac{4}{3}π", "\\frac{4}{3}\\pi"), ("4pi", "4\\pi"),
    ("8mm", "8"), ("5m", "5"), ("4πcm^{2}", "4\\pi"), ("2√{3}cm", "2\\sqrt{3}"), ("8cm^2^", "8"),
    ("27cm²", "27"), ("6平方米", "6"), ("4\\pi\\,\\text{cm}^2", "4\\pi"),
    # not units: a variable or a letter that is no unit after a value, units with no value, 'pi' inside words
    ("2x", "2x"), ("m", "m"), ("cm", "cm"), ("x m", "x m"), ("\\frac{1}{m}", "\\frac{1}{m}"), ("2m+n", "2m+n"),
    ("spin", "spin"), ("\\pi", "\\pi"), ("\\sin x", "\\sin x"),
])
def test_math_text_with_units_stripped(text, latex):
    assert math_text(text, strip_units=True) == latex


def test_units_stay_unless_asked_and_long_answers_are_left_as_they_are():
    assert math_text("27cm^{2}") == "27cm^{2}" and math_text("2√{3}") == "2\\sqrt{3}"
    long = "1" * 5000 + "cm"
    assert math_text(long, strip_units=True) == long  # never parsed (over the parse limit): no regex work on it
    assert math_reward(said("2\\sqrt{3}"), "2√{3}") == 1.0  # roots and pi are read without strip_units too
