"""The vLLM engine's multi-turn rollouts (gpg_vl/rollout/vllm/colocated.py), on CPU against a scripted stand-in for
vllm.LLM that honours max_tokens, stop token ids and stop strings as vLLM does: what each turn's requests hold (one
placeholder per image, never processor-expanded ids; the images of every turn), the trajectories assembled from
its segments, and the sampler's log-probs aligned with the generated tokens (0 on observations); for Qwen2.5-VL
(observations as user turns), Qwen3-VL (the template's tool role) and Qwen3.5 (XML tool calls)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.learners import learner_for
from helpers.runs import tiny_family_policy
from PIL import Image

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.errors import UserError
from gpg_vl.models.batch import trim_left_padding
from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.vllm.colocated import VLLMEngine, engine_options

MAX_NEW = 100
JUNK = " and then more text that a stop string must cut off"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5"])  # user turn; tool role; XML calls
def family_policy(request, tmp_path_factory):
    return tiny_family_policy(request.param, tmp_path_factory)


class ScriptedLLM:
    """vllm.LLM's generate for tests: `script(call, row)` gives the tokens a completion would run to (call: the
    generate call's number; row: the completion's number within it); they are cut as vLLM cuts them, after the
    first stop token id, after the token that completes a stop string, or at max_tokens. Each token's log-prob
    is a distinct number, recorded in `logps[(call, row)]`."""

    def __init__(self, tokenizer, script, logps_of=None) -> None:
        self.tokenizer, self.script, self.calls, self.logps = tokenizer, script, [], {}
        self.logps_of = logps_of  # (call, row) -> the log-probs to report for that completion, else the formula

    def collective_rpc(self, method, kwargs):  # the sync: the workers' reload_weights
        list(kwargs["weights_iterator"])

    def generate(self, requests, params, use_tqdm=False):
        call = len(self.calls)
        self.calls.append((requests, params))
        outputs, row = [], 0
        for param in params:
            completions = []
            for _ in range(param["n"]):
                tokens = self.cut(self.script(call, row), param)
                logps = [-(call + 1) / 10 - (row + 1) / 100 - t / 1000 for t in range(len(tokens))]
                if self.logps_of is not None:
                    logps = self.logps_of(call, row)[:len(tokens)]
                self.logps[(call, row)] = logps
                completions.append(SimpleNamespace(token_ids=tokens, logprobs=[
                    {token: SimpleNamespace(logprob=lp)} for token, lp in zip(tokens, logps, strict=True)]))
                row += 1
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs

    def cut(self, tokens: list[int], param: dict) -> list[int]:
        for k, token in enumerate(tokens):
            text = self.tokenizer.decode(tokens[:k + 1], skip_special_tokens=param["skip_special_tokens"])
            if (token in param["stop_token_ids"] or any(stop in text for stop in param.get("stop", []))
                    or k + 1 >= param["max_tokens"]):
                return tokens[:k + 1]
        return tokens

    def sleep(self, level):
        pass

    def wake_up(self, tags=None):
        pass


def prompts(family_policy, tools) -> EnginePrompts:
    messages = [[{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", size, color)},
                                              {"type": "text", "text": text}]}]
                for size, color, text in (((200, 150), (0, 90, 0), "What is it?"),
                                          ((160, 240), (90, 0, 0), "Which shape is red? Look closely."))]
    return EnginePrompts(family_policy.family.encode(messages, tools=tools), messages)


def call_text(family_policy, box) -> str:
    if family_policy.family.tool_call_format == "xml":
        return f"<tool_call>\n<function=zoom_in>\n<parameter=bbox_2d>\n{box}\n</parameter>\n</function>\n</tool_call>"
    return f'<tool_call>\n{{"name": "zoom_in", "arguments": {{"bbox_2d": {box}}}}}\n</tool_call>'


def rollout_through(family_policy, *, group_size=2, logps_of=None, **settings):
    """B=2, G=2 through the engine. First turn: row 0 a good crop, row 1 an answer, row 2 a box too small (an
    error observation), row 3 a crop; each call followed by text past the stop string. Later turns: answers."""
    family = family_policy.family
    tokens = lambda text: family.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = VLLMEngine(family_policy, RolloutSettings(vllm={"enable_sleep_mode": False}),
                        llm=ScriptedLLM(family.tokenizer, None, logps_of), sampling_params=dict)
    engine.take_tools(MultiTurnSettings(**{"max_turns": 2, **settings}), ("zoom_in",))
    batch = prompts(family_policy, engine.prompt_tools(SimpleNamespace(describe_tools=True)))

    def box(prompt, region):
        frame = family.to_model_frame(region, batch.batch.image_sizes[prompt][0])
        return "[" + ", ".join(str(round(v)) for v in frame) + "]"

    first = {0: call_text(family_policy, box(0, (10, 10, 150, 120))), 1: "The answer is a circle.",
             2: call_text(family_policy, box(1, (0, 0, 20, 20))),
             3: call_text(family_policy, box(1, (20, 40, 140, 200)))}
    eos = family.eos_ids[0]

    def script(call, row):
        if call == 0:
            return tokens(first[row] + JUNK) + ([eos] if row == 1 else [])
        return tokens(f"Seen it: answer {row}.") + [eos]

    engine.llm.script = script
    rollout = engine.generate(batch, group_size, Sampling(max_new_tokens=MAX_NEW, greedy=True))
    return engine, batch, rollout, tokens


def collapse(ids: list[int], pad: int) -> list[int]:
    """Runs of the image pad token as one: processor-expanded ids as the tokenizer writes them before expansion."""
    return [token for k, token in enumerate(ids) if token != pad or k == 0 or ids[k - 1] != pad]


def test_each_turns_requests_hold_one_placeholder_per_image_and_every_turns_images(family_policy):
    engine, batch, rollout, tokens = rollout_through(family_policy)
    family, llm = family_policy.family, engine.llm
    pad = family.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(llm.calls) == 2
    (first, first_params), (later, later_params) = llm.calls
    assert len(first) == 2 and [p["n"] for p in first_params] == [2, 2]  # one request per prompt, n = G
    assert len(later) == 3 and [p["n"] for p in later_params] == [1, 1, 1]  # rows 0, 2, 3 go on
    for params in first_params + later_params:
        assert params["stop"] == ["</tool_call>"] and params["stop_token_ids"] == family.eos_ids
        assert params["logprobs"] == 0 and params["detokenize"] and not params["skip_special_tokens"]
    assert [p["max_tokens"] for p in first_params] == [MAX_NEW] * 2
    trajectories = rollout.trajectories
    for request in first + later:
        images = request["multi_modal_data"]["image"]
        assert request["prompt_token_ids"].count(pad) == len(images)  # never expanded (TRL #6294)
    assert [len(r["multi_modal_data"]["image"]) for r in later] == [2, 1, 2]  # row 2's observation: an error text
    for request, row in zip(later, [0, 2, 3], strict=True):
        trajectory = trajectories[row]
        prompt = trim_left_padding(batch.batch.select([row // 2]).inputs)["input_ids"][0].tolist()
        seen = prompt + trajectory.token_ids[:trajectory.observations[0][1]]  # what the update scores, expanded
        assert request["prompt_token_ids"] == collapse(seen, pad)
        assert request["multi_modal_data"]["image"][1:] == trajectory.images  # the crop, as the trainer's processor
        assert request["multi_modal_data"]["image"][0] is first[row // 2]["multi_modal_data"]["image"][0]
    # the prompt lists the tools, as the trainer encoded it
    assert first[0]["prompt_token_ids"] == collapse(trim_left_padding(batch.batch.select([0]).inputs)[
        "input_ids"][0].tolist(), pad) and "zoom_in" in family.tokenizer.decode(first[0]["prompt_token_ids"])


def test_trajectories_are_assembled_from_the_segments_and_logps_align(family_policy):
    engine, _, rollout, tokens = rollout_through(family_policy)
    family, llm = family_policy.family, engine.llm
    crop, answer, refused, crop_again = rollout.trajectories
    assert (crop.turns, len(crop.images), crop.calls[0].error, crop.limit) == (2, 1, False, "none")
    assert (answer.turns, answer.calls) == (1, [])
    assert refused.turns == 2 and refused.calls[0].error and "short side" in refused.calls[0].text
    assert crop_again.turns == 2 and len(crop_again.crop_boxes) == 1 and crop_again.crop_boxes[0][0] == 0
    segment = crop.token_ids[slice(*crop.segments[0])]
    assert family.tokenizer.decode(segment).endswith("</tool_call>")  # cut at the stop string: no junk after
    assert "more text" not in family.tokenizer.decode(crop.token_ids)
    assert crop.token_ids[slice(*crop.segments[1])] == tokens("Seen it: answer 0.") + [family.eos_ids[0]]
    later_rows = {0: 0, 2: 1, 3: 2}  # trajectory -> its completion's number in the second call
    for row, trajectory in enumerate(rollout.trajectories):
        n = len(trajectory.token_ids)
        assert rollout.completion_ids[row, :n].tolist() == trajectory.token_ids
        assert rollout.loss_mask[row, :n].tolist() == trajectory.loss_mask
        expected = llm.logps[(0, row)] + [0.0] * sum(e - s for s, e in trajectory.observations)
        if row in later_rows:
            expected += llm.logps[(1, later_rows[row])]
        assert trajectory.logps == pytest.approx(expected)
        assert rollout.sampler_logps[row, :n].tolist() == pytest.approx(expected)
        assert rollout.sampler_logps[row, n:].abs().sum() == 0
    assert torch.all(rollout.sampler_logps[rollout.loss_mask == 0] == 0)  # observations and padding


def test_segments_get_what_is_left_of_the_token_budget_and_limits_end_trajectories(family_policy):
    engine, _, rollout, _ = rollout_through(family_policy, max_total_tokens=1000, max_images=0)
    (_, first_params), (later, later_params) = engine.llm.calls
    assert [r["multi_modal_data"]["image"].__len__() for r in later] == [1]  # only the error observation is added
    assert rollout.trajectories[0].limit == "image" and rollout.trajectories[3].limit == "image"
    refused = rollout.trajectories[2]
    assert later_params[0]["max_tokens"] == min(MAX_NEW, 1000 - refused.observations[0][1])
    engine, _, rollout, _ = rollout_through(family_policy, max_total_tokens=12)
    assert [p["max_tokens"] for p in engine.llm.calls[0][1]] == [12, 12] and len(engine.llm.calls) == 1
    assert all(t.limit == "token" for t in rollout.trajectories if t.token_ids[-1] not in family_policy.family.eos_ids)


def test_a_model_that_cannot_carry_images_in_later_turns_is_refused_in_one_sentence(family_policy, monkeypatch):
    engine = VLLMEngine(family_policy, RolloutSettings(), llm=ScriptedLLM(family_policy.family.tokenizer, None),
                        sampling_params=dict)
    monkeypatch.setattr(family_policy.family, "multi_turn_unsupported", lambda: "its template drops tool images")
    with pytest.raises(UserError, match=r"rollout.max_turns=3 cannot run on this model: its template drops tool "
                                        r"images; set rollout.max_turns=1\."):
        engine.take_tools(MultiTurnSettings(max_turns=3), ("zoom_in",))
    engine.take_tools(MultiTurnSettings(max_turns=1), ())  # single turn: nothing to check


def test_engine_options_plan_for_whole_trajectories():
    family = SimpleNamespace(engine_processor_kwargs=lambda: {}, engine_takes_video=False)
    single = engine_options(RolloutSettings(max_new_tokens=64, max_prompt_tokens=1000), model_path="/m",
                            family=family, dtype=torch.bfloat16, seed=0)
    turns = engine_options(RolloutSettings(max_new_tokens=64, max_prompt_tokens=1000, max_turns=3,
                                           max_total_tokens=3000, max_images=5), model_path="/m", family=family,
                           dtype=torch.bfloat16, seed=0)
    assert (single["max_model_len"], single["limit_mm_per_prompt"]) == (1064, {"image": 4})
    assert (turns["max_model_len"], turns["limit_mm_per_prompt"]) == (4000, {"image": 9})


def test_the_updates_on_policy_check_reads_the_sampler_logps_at_the_generated_tokens(family_policy):
    """vLLM reporting the trainer's own log-probs for each segment: the update's logp_mismatch is 0, so every
    sampler log-prob sits at the position of the token it belongs to, and observation tokens are not compared."""

    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.models.scoring import ScoringPath, token_logps
    from gpg_vl.rollout.engine import Correction
    from gpg_vl.train.step.sample import Attempt
    from gpg_vl.train.step.update import update

    _, batch, rollout, _ = rollout_through(family_policy)
    family = family_policy.family
    with torch.no_grad():
        trainer = token_logps(family, family_policy.model, batch.batch, [0, 0, 1, 1], rollout.completion_ids,
                              rollout.completion_mask, observations=rollout.trajectories, path=ScoringPath())
    later = [0, 2, 3]  # the trajectories that took a second turn, in the second call's order

    def logps_of(call, row):
        trajectory = rollout.trajectories[row if call == 0 else later[row]]
        start, end = trajectory.segments[call]
        return trainer[row if call == 0 else later[row], start:end].tolist()

    _, batch, rollout, _ = rollout_through(family_policy, logps_of=logps_of)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    attempt = Attempt(rows=[{"id": 0}, {"id": 1}], prompts=batch.batch, rollout=rollout, rewards=rewards,
                      components={"r": rewards}, advantages=rewards - 0.5, valid=torch.tensor([True, True]))
    settings = TrainerSettings(group_size=2, batch_size=2, lr=0.0, micro_batch_tokens=0)
    learner = learner_for(family_policy, settings, correction=Correction(sampler_check=True))
    assert update(learner, [attempt])["logp_mismatch_mean"] < 1e-5
    family_policy.model.zero_grad()
    shifted = rollout.sampler_logps.clone()
    shifted[rollout.loss_mask == 0] = 5.0  # observation positions: not compared
    attempt.rollout.sampler_logps = shifted
    assert update(learner, [attempt])["logp_mismatch_max"] < 1e-5
    family_policy.model.zero_grad()
    attempt.rollout.sampler_logps = torch.roll(rollout.sampler_logps, 1, dims=1)  # one position off: seen
    assert update(learner, [attempt])["logp_mismatch_mean"] > 0.1
    family_policy.model.zero_grad()


def test_later_turns_keep_the_first_requests_other_media_and_keywords():
    """A prompt's other media (a video) and processor keywords ride along every turn; its images grow."""
    from gpg_vl.rollout.multiturn.trajectory import Trajectory
    from gpg_vl.rollout.vllm.colocated import TurnRow, turn_requests

    family = SimpleNamespace(suppressed_ids=[9], eos_ids=[2], tool_stop_strings=("</tool_call>",))
    first = {"prompt_token_ids": [1, 5, 6], "multi_modal_data": {"video": ["frames"]},
             "mm_processor_kwargs": {"do_sample_frames": False}}
    row = TurnRow(0, Trajectory(), None, [1, 5, 6, 7, 8, 5], ["crop"], first)
    (request,), (params,) = turn_requests(family, [row], 1, Sampling(max_new_tokens=4), MultiTurnSettings(), dict)
    assert request == {"prompt_token_ids": [1, 5, 6, 7, 8, 5], "mm_processor_kwargs": {"do_sample_frames": False},
                       "multi_modal_data": {"video": ["frames"], "image": ["crop"]}}
    assert first["multi_modal_data"] == {"video": ["frames"]} and params["max_tokens"] == 4
    bare = TurnRow(0, Trajectory(), None, [1, 2], [], {"prompt_token_ids": [1, 2]})
    assert turn_requests(family, [bare], 1, Sampling(max_new_tokens=4), MultiTurnSettings(), dict)[0] == [
        {"prompt_token_ids": [1, 2]}]


def test_engine_options_plan_for_videos_where_the_model_takes_them():
    takes_video = SimpleNamespace(engine_processor_kwargs=lambda: {}, engine_takes_video=True)
    options = engine_options(RolloutSettings(), model_path="/m", family=takes_video, dtype=torch.bfloat16, seed=0)
    assert options["limit_mm_per_prompt"] == {"image": 4, "video": 1}
    none = engine_options(RolloutSettings(vllm={"max_videos": 0}), model_path="/m", family=takes_video,
                          dtype=torch.bfloat16, seed=0)
    assert none["limit_mm_per_prompt"] == {"image": 4}
