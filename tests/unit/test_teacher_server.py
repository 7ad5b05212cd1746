"""The teacher on vLLM servers' pure parts (gpg_vl/train/teacher/server.py): the scoring request, both answer formats
(vLLM's V2 runner's token-id rows, renormalized without the vision placeholders, and prompt_logprobs), which format
a server takes, and every setting refused in one sentence before a server is asked. The real server:
tests/integration/test_teacher_server_real.py."""

from __future__ import annotations

import base64
import io
import math
import socket

import numpy as np
import pytest

from gpg_vl.config.schema import RolloutSettings, TeacherSettings, TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.vllm.client import Rejected, ServerError
from gpg_vl.train.teacher.build import require_teacher_settings
from gpg_vl.train.teacher.server import (
    _takes_token_ids,
    answer_logps,
    connect_teacher,
    renormalized,
    score_body,
    tokenizer_problem,
)


def npy(array) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, dtype=np.float32), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_request_scores_the_completions_positions():
    # prompt [5, 6, 7] then completion [8, 9]: start 2 (the last prompt position) scores tokens 3 and 4
    body = score_body("m", [5, 6, 7, 8, 9], 2, None, by_ids=True, suppressed=(40, 41))
    params = body["sampling_params"]
    assert params["prompt_logprob_token_ids"] == [[8, 40, 41], [9, 40, 41]] and params["prompt_logprob_start"] == 2
    assert params["max_tokens"] == 1 and "features" not in body and body["token_ids"] == [5, 6, 7, 8, 9]
    plain = score_body("m", [5, 6, 7, 8, 9], 2, {"mm_hashes": {}}, by_ids=False)
    assert plain["sampling_params"]["prompt_logprobs"] == 0
    assert "prompt_logprob_token_ids" not in plain["sampling_params"]
    assert plain["features"] == {"mm_hashes": {}}


def test_prompt_logprobs_answers_give_each_completion_tokens_own_log_prob():
    answer = {"prompt_logprobs": [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}, "3": {"logprob": -0.1}},
                                  {"8": {"logprob": -0.5}, "1": {"logprob": -1.2}}, {"9": {"logprob": -0.25}}]}
    assert answer_logps(answer, [5, 6, 7, 8, 9], 2) == [-0.5, -0.25]
    assert answer_logps(answer, [5, 6, 7, 8, 9], 0) == [-1.0, -2.0, -0.5, -0.25]
    with pytest.raises(ServerError, match=r"^a teacher server gave no log-prob for token 4 of a scored sequence"):
        answer_logps({"prompt_logprobs": answer["prompt_logprobs"][:4]}, [5, 6, 7, 8, 9], 2)


def test_token_id_rows_are_renormalized_without_the_suppressed_ids():
    # p(token) = 0.5 with 0.1 + 0.1 on two placeholders: 0.5 / (1 - 0.2) = 0.625 without them
    rows = [[math.log(0.5), math.log(0.1), math.log(0.1)], [math.log(0.2), math.log(0.3), -math.inf]]
    found = answer_logps({"prompt_token_id_logprobs": npy(rows)}, [5, 6, 7, 8, 9], 2)
    assert found == pytest.approx([math.log(0.625), math.log(0.2 / 0.7)], abs=1e-6)
    assert renormalized(np.log(np.array([[0.25]]))).tolist() == pytest.approx([math.log(0.25)])  # nothing suppressed
    loop = [math.log(math.exp(r[0]) / (1 - sum(math.exp(v) for v in r[1:]))) for r in rows]  # the slow reference
    assert renormalized(np.array(rows)).tolist() == pytest.approx(loop)
    with pytest.raises(ServerError, match=r"^a teacher server returned scored rows of shape \(1, 3\) for 2 tokens"):
        answer_logps({"prompt_token_id_logprobs": npy(rows[:1])}, [5, 6, 7, 8, 9], 2)


class Answers:
    """A server whose POSTs answer in turn from `answers` (an exception is raised)."""

    url = "http://teacher:8000"

    def __init__(self, *answers) -> None:
        self.answers, self.bodies = list(answers), []

    def post(self, route, body=None, **named):
        self.bodies.append(body)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_server_is_asked_by_token_ids_where_it_takes_them_else_by_prompt_logprobs():
    rows = {"prompt_token_id_logprobs": npy([[-0.5], [-0.7], [-0.1]])}
    assert _takes_token_ids(Answers(rows), "m", [1, 2, 3, 4]) is True
    refusal = "prompt_logprob_token_ids requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)."
    own = {"prompt_logprobs": [None, *({str(t): {"logprob": -1.0}} for t in (2, 3, 4))]}
    v1 = Answers(Rejected("u", 400, refusal), own)
    assert _takes_token_ids(v1, "m", [1, 2, 3, 4]) is False
    assert "prompt_logprobs" in v1.bodies[1]["sampling_params"]
    with pytest.raises(UserError, match=r"^the teacher server at http://teacher:8000 has no /inference/v1/generate "
                                        r"route; restart it with --enable-scale-out"):
        _takes_token_ids(Answers(Rejected("u", 404, "Not Found")), "m", [1, 2, 3, 4])
    with pytest.raises(UserError, match=r"^the teacher server at http://teacher:8000 refused a scoring request "
                                        r"\(bad\)"):
        _takes_token_ids(Answers(Rejected("u", 400, "bad")), "m", [1, 2, 3, 4])


def test_another_tokenizer_or_vocabulary_is_named():
    assert tokenizer_problem("http://t", [1, 2], [1, 2], (401, 401)) is None
    assert tokenizer_problem("http://t", [1, 2], [1, 2], (None, 401)) is None  # the server hides its config
    for served, vocab in (([1, 3], (401, 401)), ([1, 2], (402, 401))):
        assert tokenizer_problem("http://t", served, [1, 2], vocab).startswith(
            "the teacher server at http://t has another tokenizer or vocabulary than the student (teacher.urls)")


def test_settings_that_cannot_go_with_a_server_teacher_are_refused_before_it_is_asked():
    trainer = TrainerSettings()
    with pytest.raises(UserError, match=r"^teacher.model and teacher.urls both name a teacher; set one"):
        require_teacher_settings(TeacherSettings(model="x", urls="http://t:1"), trainer)
    with pytest.raises(UserError, match=r"^teacher.loss=jsd reads the teacher's whole distribution"):
        require_teacher_settings(TeacherSettings(urls="http://t:1", loss="jsd"), trainer)
    with pytest.raises(UserError, match=r"^teacher.urls with trainer.max_staleness >= 1 is not supported"):
        require_teacher_settings(TeacherSettings(urls="http://t:1"), TrainerSettings(max_staleness=1))
    require_teacher_settings(TeacherSettings(urls="http://t:1"), trainer)  # fine
    with pytest.raises(UserError, match=r"^teacher.urls scores with the teacher's own distribution at temperature 1 "
                                        r"\(vLLM's prompt log-probs\), but rollout.temperature=0.7"):
        connect_teacher(TeacherSettings(urls="http://t:1"), tokenizer=None, vocab_size=None,
                        rollout=RolloutSettings(temperature=0.7))
    with pytest.raises(UserError, match=r"^teacher.urls holds 'localhost:8000', which is not an http\(s\)://host:port"):
        connect_teacher(TeacherSettings(urls="localhost:8000"), tokenizer=lambda text, **_: {"input_ids": [1]},
                        vocab_size=None, rollout=RolloutSettings())
    assert connect_teacher(TeacherSettings(), tokenizer=None, vocab_size=None, rollout=RolloutSettings()) is None


def test_no_server_at_the_url_is_one_sentence():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(UserError, match=rf"^no vLLM server answers at http://127.0.0.1:{port} \(GET /health, for "
                                        r"teacher.timeout_s=0.5 s\); start `vllm serve TEACHER --enable-scale-out`"):
        connect_teacher(TeacherSettings(urls=f"http://127.0.0.1:{port}", timeout_s=0.5),
                        tokenizer=lambda text, **_: {"input_ids": [1]}, vocab_size=None, rollout=RolloutSettings())


def test_a_server_that_refuses_to_process_a_video_is_one_sentence():
    import torch

    from gpg_vl.rollout.vllm.server import render_features

    refusing = Answers(Rejected("u", 400, "Per-request mm_processor_kwargs are disabled by default because they can "
                                "change multimodal preprocessing resource usage. Start the server with "
                                "--trust-request-mm-kwargs only when clients are trusted."))
    video = (torch.zeros(2, 3, 28, 28), {"fps": 2.0, "frames_indices": [0, 1], "total_num_frames": 2})
    with pytest.raises(ServerError, match=r"^the vLLM server at http://teacher:8000 refused to process a video "
                                          r"because it takes no per-request processor settings.*restart it with "
                                          r"--trust-request-mm-kwargs"):
        render_features(refusing, "m", {"video": [video]}, {})
