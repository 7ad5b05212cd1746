"""Video prompts on the tiny models of every family that takes video (Qwen-VL families, GLM-4.1V, InternVL,
Gemma 4).

- the metadata reaches the processor: Qwen2.5-VL's `second_per_grid_ts` and Qwen3-VL's frame timestamps
  equal hand-computed values for a 4-second clip at 2 fps and at 1 fps (not the processor's 24-fps default);
- one update's gradient with every fast path (prompt-once, shared video features, chunked logits,
  micro-batches) equals the plain path's on video prompts (2 prompts of different lengths, G = 2, ragged
  completions);
- prompt-once prefill gives transformers `generate`'s greedy tokens on video prompts; every HF decoder's behaviour
  log-probs are the update's (the same positions, the family's);
- GLM-4.1V's and Gemma 4's frame times come from the metadata (hand-computed at 2 and 1 fps); a subset of a
  generic batch mixing videos and images selects the same tensors as its prompts encoded alone;
- a generic model type without video refuses it in one sentence naming the model and why; a broken video is a
  counted bad row.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.gradients import one_update_gradient
from helpers.runs import tiny_family_policy, untimed
from helpers.scoring import token_logps
from helpers.video_attempts import two_video_prompts, video_attempt, video_messages
from helpers.video_clips import clip_frames, write_clip

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Sampling
from gpg_vl.rollout.hf import DECODERS, generate
from gpg_vl.train.step.micro_batch import update_chunks

VIDEO_FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "internvl",
                  "gemma4"]


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def video_policy(request, tmp_path_factory):
    policy = tiny_family_policy(request.param, tmp_path_factory)
    policy.family.video_pixels = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}  # a few tokens per frame pair
    return policy


def test_one_update_gradient_with_every_fast_path_equals_the_plain_update_on_video(video_policy):
    attempt = video_attempt(video_policy)
    common = {"max_grad_norm": 1e9, "group_size": 2}
    plain = TrainerSettings(**common, share_vision=False, share_prompt=False, logits_chunk_tokens=0,
                            micro_batch_tokens=0, micro_batch_size=100)
    budget = int(attempt.prompts.inputs["attention_mask"].sum(dim=1).max()) + 6  # a prompt and one completion
    assert len(list(update_chunks([attempt], 0, budget, share_prompt=True))) > 2  # groups split across them
    reference = one_update_gradient(video_policy, attempt, plain)
    scale = float(reference.abs().max())
    for fast in (TrainerSettings(**common, share_vision=True, share_prompt=True, logits_chunk_tokens=3,
                                 micro_batch_tokens=budget),  # prompt-once: the video tower once per group
                 TrainerSettings(**common, share_vision=True, share_prompt=False, logits_chunk_tokens=5)):
        torch.testing.assert_close(one_update_gradient(video_policy, attempt, fast), reference, rtol=1e-4,
                                   atol=2e-5 * scale)


def test_prompt_once_prefill_gives_generate_s_greedy_tokens_on_video(video_policy):
    declined = video_policy.family.prefill_once_unsupported(video_policy.model)
    if declined is not None:  # Gemma 4 steps aside, as on images (tests/integration/test_fast_paths.py)
        assert "sliding-window" in declined and declined in video_policy.family.describe(video_policy.model)
        return
    prompts, group_size = two_video_prompts(video_policy), 2
    greedy = Sampling(max_new_tokens=8, greedy=True)
    every_row = generate(video_policy, prompts.select([0, 0, 1, 1]), group_size=1, sampling=greedy,
                         prefill_once=False, decode="generate")
    for decode in DECODERS:
        once = generate(video_policy, prompts, group_size=group_size, sampling=greedy, prefill_once=True,
                        decode=decode)
        assert torch.equal(once.completion_ids, every_row.completion_ids), decode


@pytest.mark.parametrize("decode, prefill_once", [("loop", True), ("generate", True), ("generate", False)])
def test_every_decoder_samples_video_at_the_positions_the_update_scores(video_policy, decode, prefill_once):
    """The behaviour log-probs of each HF decoder (the decode loop; transformers' `generate` continuing the forked
    prefill, or prefilling every row) are the update's on video prompts: both place every token by the family's
    `position_ids` (Qwen2-VL and Qwen2.5-VL: not by the model's own `get_rope_index`, which places the text after
    these multi-patch clips elsewhere)."""
    prompts = two_video_prompts(video_policy)
    sampling = Sampling(max_new_tokens=6, temperature=0.7)
    torch.manual_seed(0)
    # every row prefilled: the rows given one by one (transformers 5.25's generate cannot repeat GLM-4.1V's videos)
    rollout = generate(video_policy, prompts, group_size=2, sampling=sampling, prefill_once=True, decode=decode) \
        if prefill_once else generate(video_policy, prompts.select([0, 0, 1, 1]), group_size=1, sampling=sampling,
                                      prefill_once=False, decode=decode)
    with torch.no_grad():
        scored = token_logps(video_policy.family, video_policy.model, prompts, [0, 0, 1, 1], rollout.completion_ids,
                             rollout.completion_mask, temperature=0.7)
    mask = rollout.completion_mask
    assert mask.any() and torch.allclose(rollout.sampler_logps[mask], scored[mask], atol=1e-4)


# 4 s at 8 fps = 32 frames. 2 fps: 8 frames at round(i * 31 / 7) = 0 4 9 13 18 22 27 31; 1 fps: 4 frames at
# round(i * 31 / 3) = 0 10 21 31. The sampled rate is frames / total * 8 fps = 2 (1), so one temporal grid step
# (2 frames) lasts 2 / 2 = 1 s (2 / 1 = 2 s), not 2 / 24 s. Qwen3-VL's timestamp of a frame pair is the mean of
# its frames' index / 8: (0 + 4) / 16 = 0.25, (9 + 13) / 16 = 1.375, (18 + 22) / 16 = 2.5, (27 + 31) / 16 = 3.625;
# at 1 fps (0 + 10) / 16 = 0.625, (21 + 31) / 16 = 3.25; written with one decimal.
SECONDS = {2: [1.0], 1: [2.0]}  # one value per video: seconds per temporal grid step
TIMESTAMPS = {2: ["0.2", "1.4", "2.5", "3.6"], 1: ["0.6", "3.2"]}


def four_second_clip_prompt(tmp_path, fps: float) -> list[dict]:
    """The messages of a 4-second MPEG-4 clip at 8 fps, read through the prompt stream at `fps`."""
    clip = write_clip(tmp_path / "clip.mp4", seconds=4, fps=8)
    stream = PromptStream([{"video": str(clip)}], seed=0)
    task = type("Task", (), {"check_row": lambda self, row: None, "max_video_frames": 16,
                             "messages": lambda self, row: video_messages(row["video"], "Where?", fps=fps)})()
    return stream.next_prompts(1, task)[0].messages


@pytest.mark.parametrize("fps", [2, 1])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_metadata_gives_hand_computed_grid_seconds_and_timestamps(tmp_path_factory, tmp_path, family, fps):
    policy = tiny_family_policy(family, tmp_path_factory)
    policy.family.video_pixels = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    prompts = policy.family.encode([four_second_clip_prompt(tmp_path, fps)])
    grid = prompts.inputs["video_grid_thw"][0].tolist()
    assert grid[0] == len(TIMESTAMPS[fps])  # temporal grid steps: frames / 2
    if family == "qwen2_5_vl":
        assert prompts.inputs["second_per_grid_ts"].tolist() == SECONDS[fps]
    else:
        text = policy.family.tokenizer.decode(prompts.inputs["input_ids"][0])
        assert re.findall(r"<([\d.]+) seconds>", text) == TIMESTAMPS[fps]


# GLM-4.1V writes the whole seconds of the first frame of each pair after it: index / 8 of frames 0 9 18 27 at
# 2 fps (0, 1.125, 2.25, 3.375), of frames 0 21 at 1 fps (0, 2.625), truncated (at 24 fps: 0 0 0 1). Gemma 4
# writes mm:ss before every frame: 0 4 9 13 18 22 27 31 / 8 at 2 fps, 0 10 21 31 / 8 at 1 fps, truncated.
FRAME_TIMES = {"glm4v": (r"<\|end_of_image\|>(\d+)", {2: ["0", "1", "2", "3"], 1: ["0", "2"]}),
               "gemma4": (r"(\d\d:\d\d) <\|image>", {2: [f"00:0{s}" for s in (0, 0, 1, 1, 2, 2, 3, 3)],
                                                      1: ["00:00", "00:01", "00:02", "00:03"]})}


@pytest.mark.parametrize("fps", [2, 1])
@pytest.mark.parametrize("family", sorted(FRAME_TIMES))
def test_generic_models_write_hand_computed_frame_times_from_the_metadata(tmp_path_factory, tmp_path, family, fps):
    policy = tiny_family_policy(family, tmp_path_factory)
    prompts = policy.family.encode([four_second_clip_prompt(tmp_path, fps)])
    assert prompts.videos_per_prompt == [1]
    pattern, expected = FRAME_TIMES[family]
    assert re.findall(pattern, policy.family.tokenizer.decode(prompts.inputs["input_ids"][0])) == expected[fps]


def test_the_processor_without_metadata_would_assume_24_fps(tmp_path_factory):
    """The pitfall the metadata avoids: the same frames without it get 2 / 24 s per grid step."""
    policy = tiny_family_policy("qwen2_5_vl", tmp_path_factory)
    frames, _ = policy.family._video_frames({"video": clip_frames(8), "fps": 2, "min_pixels": 1024,
                                              "max_pixels": 4096})
    text = policy.family.render(video_messages(clip_frames(8), "q"))
    bare = policy.processor(text=[text], videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert bare["second_per_grid_ts"].tolist() == pytest.approx([2 / 24])
    ours = policy.family.encode([video_messages(clip_frames(8), "q", fps=2, min_pixels=1024, max_pixels=4096)])
    assert ours.inputs["second_per_grid_ts"].tolist() == [1.0]


def test_a_broken_video_is_a_counted_bad_row(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 20)
    write_clip(tmp_path / "good.mp4", seconds=1)
    rows = [{"video": str(tmp_path / "broken.mp4")}, {"video": str(tmp_path / "good.mp4")}]
    task = type("Task", (), {"check_row": lambda self, row: None, "max_video_frames": 4,
                             "messages": lambda self, row: video_messages(row["video"], "q")})()
    stream = PromptStream(rows, seed=0, warn=lambda message: None)
    prompts = stream.next_prompts(1, task)
    assert stream.bad.by_reason == {"undecodable video": 1}
    assert prompts[0].messages[0]["content"][0]["video_metadata"]["fps"] == 8.0


@pytest.mark.parametrize(("family", "model_type", "why"), [
    ("llava_onevision", "llava_onevision", "different frame counts"), ("smolvlm", "idefics3", "takes no video")])
def test_a_generic_family_refuses_video_in_one_sentence_naming_the_model(tmp_path_factory, family, model_type, why):
    policy = tiny_family_policy(family, tmp_path_factory)
    with pytest.raises(UserError, match=f"{model_type} model .*does not take video prompts .*{why}"):
        policy.family.encode([video_messages(clip_frames(4), "q")])


def test_internvl_refuses_one_prompt_s_videos_of_different_frame_counts(tmp_path_factory):
    """Its processor stacks a call's videos: one prompt's videos must share a frame count (prompts may differ)."""
    policy = tiny_family_policy("internvl", tmp_path_factory)
    two = [{"role": "user", "content": [{"type": "video", "video": clip_frames(4)},
                                        {"type": "video", "video": clip_frames(6)}, {"type": "text", "text": "q"}]}]
    with pytest.raises(UserError, match="internvl model's processor cannot take videos of different frame counts"):
        policy.family.encode([two])
    same = policy.family.encode([[{"role": "user", "content": [two[0]["content"][0]] * 2}],
                                  video_messages(clip_frames(6), "q")])
    assert same.videos_per_prompt == [2, 1] and same.rows["pixel_values"] == [8, 6]  # one tile per frame


CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
           "glm4v": "Glm4vForConditionalGeneration", "internvl": "InternVLForConditionalGeneration",
           "gemma4": "Gemma4ForConditionalGeneration"}
CLI_MODELS = {"qwen2_5_vl": "tiny", "qwen2_vl": "tiny-qwen2-vl", "qwen3_vl": "tiny-qwen3-vl",
              "qwen3_vl_moe": "tiny-qwen3-vl-moe", "qwen3_5": "tiny-qwen3.5", "qwen3_5_moe": "tiny-qwen3.5-moe",
              "glm4v": "tiny-glm4v", "internvl": "tiny-internvl",
              "gemma4": "tiny-gemma4"}


# the moving-dot clips (frames lists and MPEG-4 files) through the CLI, the fast paths on
VIDEO_RUN = ["task=helpers.video_task:MovingDot", "trainer.batch_size=2", "trainer.group_size=3",
             "rollout.max_new_tokens=4", "rollout.temperature=3.0", "trainer.eval_before=false",
             "trainer.eval_after=false", "trainer.beta_th=0",
             "data.max_video_frames=4", "model.video_min_pixels=1024", "model.video_max_pixels=4096"]


def video_run(output_dir, *overrides) -> dict:
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    return train_main(load_config("train", [f"output_dir={output_dir}", *VIDEO_RUN, *overrides]))


def video_metrics(run) -> list[dict]:
    import json

    return [untimed(json.loads(x)) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_video_steps(tmp_path_factory):
    """family -> (folder, summary) of its 2-step CLI run on the video task, run the first time a test asks; the
    Qwen2.5-VL run checkpoints every step: it is also the uninterrupted run the resume test compares with."""
    runs = {}

    def run_of(family: str):
        if family not in runs:
            out = tmp_path_factory.mktemp(f"video-run-{family}")
            saving = "trainer.save_every=1" if family == "qwen2_5_vl" else "trainer.save_every=0"
            runs[family] = out, video_run(out, f"model={CLI_MODELS[family]}", "trainer.max_steps=2", saving)
        return runs[family]

    return run_of


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_two_cli_steps_on_a_video_task_and_final_reloads(two_video_steps, family):
    """Each family that reads video trains 2 steps through the CLI on the moving-dot clips (frames lists and
    MPEG-4 files), with the fast paths on, and its `final/` reloads with transformers alone."""
    from transformers import AutoModelForImageTextToText

    run, summary = two_video_steps(family)
    lines = video_metrics(run)
    assert summary["steps"] == 2 and [m["skipped"] for m in lines] == [0.0, 0.0]
    assert lines[-1]["rows_seen"] == 4 and lines[-1]["bad_rows"] == 0  # both readers read every clip
    reloaded = AutoModelForImageTextToText.from_pretrained(run / "final")  # transformers alone
    assert type(reloaded).__name__ == CLASSES[family]


def test_a_video_run_resumes_to_the_same_weights_and_metrics(tmp_path, two_video_steps):
    """Video prompts (frames lists and MPEG-4 files, read once per prompt by the stream) resume bit-exactly: 2 steps
    straight equal 1 step, a checkpoint, and 1 resumed step."""
    from safetensors.torch import load_file

    full_run, _ = two_video_steps("qwen2_5_vl")
    video_run(tmp_path / "cut", "model=tiny", "trainer.save_every=1", "trainer.max_steps=1")
    video_run(tmp_path / "cut", "model=tiny", "trainer.save_every=1", "trainer.max_steps=2", "resume=auto")
    full, cut = video_metrics(full_run), video_metrics(tmp_path / "cut")
    assert cut == full and len(full) == 2 and full[-1]["skipped"] == 0.0
    before = load_file(full_run / "final" / "model.safetensors")
    after = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_raw_text_prompt_holds_its_video_where_the_part_stands(tmp_path_factory, family):
    """model.prompt_style=raw (a base model): the video's placeholder stands where its part stands, and the
    processor expands it into the same video tokens as the chat style."""
    policy = tiny_family_policy(family, tmp_path_factory)
    chat = policy.family.encode([video_messages(clip_frames(4), "Where?", min_pixels=1024, max_pixels=4096)])
    policy.family.prompt_style = "raw"
    raw = policy.family.encode([video_messages(clip_frames(4), "Where?", min_pixels=1024, max_pixels=4096)])
    pad = policy.family.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert raw.texts[0].index("<|video_pad|>") < raw.texts[0].index("Where?")
    assert int((raw.inputs["input_ids"] == pad).sum()) == int((chat.inputs["input_ids"] == pad).sum()) > 0
    assert torch.equal(raw.inputs["video_grid_thw"], chat.inputs["video_grid_thw"])


@pytest.mark.parametrize("family", ["glm4v", "internvl", "gemma4"])
def test_a_raw_text_prompt_holds_a_generic_model_s_video_where_the_part_stands(tmp_path_factory, family):
    """GLM-4.1V, InternVL and Gemma 4: the raw style's video placeholder expands into as many frame tokens as
    the chat style's (image tokens on the first two, video tokens on Gemma 4)."""
    policy = tiny_family_policy(family, tmp_path_factory)
    chat = policy.family.encode([video_messages(clip_frames(4), "Where?")])
    policy.family.prompt_style = "raw"
    raw = policy.family.encode([video_messages(clip_frames(4), "Where?")])
    video_token = policy.family.tokenizer.convert_tokens_to_ids(policy.processor.video_token)
    tokens = torch.tensor([policy.family._image_token_id(), video_token])  # the frames' tokens

    def frame_tokens(prompts) -> int:
        return int(torch.isin(prompts.inputs["input_ids"], tokens).sum())

    assert raw.texts[0].index(policy.family.video_placeholder) < raw.texts[0].index("Where?")
    assert frame_tokens(raw) == frame_tokens(chat) > 0


@pytest.mark.parametrize("family", ["glm4v", "internvl", "gemma4"])
def test_a_generic_batch_of_videos_and_images_selects_each_prompt_s_own_rows(tmp_path_factory, family):
    """The row layout of video outputs: a subset of a mixed batch (videos of 6 and 4 frames, an image, an image
    beside a video) in another order equals those prompts encoded on their own, every tensor of it."""
    from PIL import Image

    from gpg_vl.models.batch import trim_left_padding

    policy = tiny_family_policy(family, tmp_path_factory)
    image = {"type": "image", "image": Image.new("RGB", (40, 30), (200, 30, 30))}
    batch = [video_messages(clip_frames(6), "Where?"), [{"role": "user", "content": [image, {"type": "text",
                                                                                            "text": "Colour?"}]}],
             [{"role": "user", "content": [image, *video_messages(clip_frames(4), "Both?")[0]["content"]]}]]
    prompts = policy.family.encode(batch)
    assert prompts.videos_per_prompt == [1, 0, 1] and prompts.images_per_prompt == [0, 1, 1]
    for order in ([2, 0], [1, 2], [0]):
        alone = policy.family.encode([batch[i] for i in order]).inputs
        picked = trim_left_padding(prompts.select(order).inputs)
        assert all(picked[key].shape[0] == 0 for key in picked.keys() - alone.keys())  # e.g. no image among them
        for key, value in alone.items():
            assert torch.equal(picked[key], value), (order, key)
