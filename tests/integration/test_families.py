"""The families beyond Qwen-VL 2/2.5/3 through the command line: the generic family's classes (LLaVA-OneVision,
Gemma 3, SmolVLM / Idefics3, InternVL, GLM-4.1V), Qwen3.5 dense and MoE (hybrid attention, thinking mode) and
Qwen3-VL MoE. Each: two training steps in which
every trainable parameter changes, a greedy evaluation, `final/` reloaded by transformers alone, freeze_vision
and LoRA (the vision tower found by the family), a declared box frame, and an exact resume."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from helpers.runs import tiny_family_path
from helpers.scoring import token_logps
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from gpg_vl.cli import build_policy, train_main
from gpg_vl.config.compose import load_config
from gpg_vl.errors import UserError
from gpg_vl.models import router
from gpg_vl.models.load import load_policy
from gpg_vl.reward.primitives import format_reward
from gpg_vl.rollout.types import in_task_frame

VOWELS = "task=helpers.vowel_task:Vowels"
QUICK = ["trainer.batch_size=2", "trainer.group_size=3", "rollout.max_new_tokens=5", "trainer.eval_before=false",
         "trainer.beta_th=0", "eval.limit=2", "eval.max_new_tokens=4", "trainer.lr=1e-2"]
ALIASES = {"llava_onevision": "tiny-llava-onevision", "gemma3": "tiny-gemma3", "gemma4": "tiny-gemma4",
           "smolvlm": "tiny-smolvlm",
           "qwen3_5": "tiny-qwen3.5", "internvl": "tiny-internvl", "glm4v": "tiny-glm4v",
           "qwen3_5_moe": "tiny-qwen3.5-moe", "qwen3_vl_moe": "tiny-qwen3-vl-moe"}
CLASSES = {"llava_onevision": "LlavaOnevisionForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
           "gemma4": "Gemma4ForConditionalGeneration",
           "smolvlm": "Idefics3ForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
           "internvl": "InternVLForConditionalGeneration", "glm4v": "Glm4vForConditionalGeneration",
           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
FRAMES = {"llava_onevision": "relative-1", "gemma3": "none", "gemma4": "none", "smolvlm": "none",
          "qwen3_5": "relative-1000",
          "internvl": "relative-1000", "glm4v": "relative-1000", "qwen3_5_moe": "relative-1000",
          "qwen3_vl_moe": "relative-1000"}


@pytest.fixture(scope="session")
def family_paths(tmp_path_factory):
    """family -> its tiny model's folder, each built the first time a test of this process reads it."""
    class Built(dict):
        def __missing__(self, family):
            return tiny_family_path(family, tmp_path_factory)

    return Built()


@pytest.fixture(scope="module", params=sorted(ALIASES))
def family(request):
    """The family under test; module-scoped, so each family's tests run together and share `two_steps`."""
    return request.param


def run(tmp_path, family, family_paths, *overrides):
    return train_main(load_config("train", [f"output_dir={tmp_path}", f"model={ALIASES[family]}",
                                            f"model.name_or_path={family_paths[family]}", VOWELS, *QUICK, *overrides]))


def weights(path) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in AutoModelForImageTextToText.from_pretrained(path).named_parameters()}


@pytest.fixture(scope="module")
def two_steps(family, family_paths, tmp_path_factory):
    """One two-step CLI run of `family`, checkpointing every step, and what it printed: read by the tests of
    what the run did and by the resume test (its uninterrupted run)."""
    out = tmp_path_factory.mktemp(f"two-steps-{family}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = run(out, family, family_paths, "trainer.max_steps=2", "trainer.save_every=1",
                      "trainer.keep_checkpoints=5")
    return out, summary, printed.getvalue()


def test_two_cli_steps_change_every_parameter_evaluate_and_reload_with_transformers(family_paths, family, two_steps):
    tmp_path, summary, out = two_steps
    before = weights(family_paths[family])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [0.0, 0.0]
    assert "accuracy" in summary["eval_after"] or summary["eval_after"]  # the greedy evaluation ran
    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "final")  # transformers alone
    assert type(trained).__name__ == CLASSES[family]
    # LLaVA-OneVision reads the vision tower's last hidden states before its post-layernorm (vision_feature_layer
    # -1, as the published checkpoints): that norm never takes part in the forward, so no trainer can change it
    unused = {"llava_onevision": ["model.vision_tower.post_layernorm.bias", "model.vision_tower.post_layernorm.weight"]}
    assert sorted(n for n, p in trained.named_parameters() if torch.equal(p, before[n])) == unused.get(family, [])
    # the run says in one line which paths this family takes
    assert f"box frame {FRAMES[family]}" in out and "the update scores" in out


def test_freeze_vision_and_lora_find_the_vision_tower_through_the_family(tmp_path, family_paths, family):
    before = weights(family_paths[family])
    run(tmp_path / "frozen", family, family_paths, "trainer.max_steps=1", "model.freeze_vision=true",
        "trainer.eval_after=false")
    trained = weights(tmp_path / "frozen" / "final")
    policy = build_policy(load_config("train", [f"model={ALIASES[family]}",
                                                f"model.name_or_path={family_paths[family]}"]).model, "cpu")
    roots = policy.family.vision_modules(policy.model)
    assert roots
    vision = {n for n in trained if any(n.startswith(r + ".") for r in roots)}
    assert vision and all(torch.equal(trained[n], before[n]) for n in vision)
    assert all(not torch.equal(trained[n], before[n]) for n in trained if n not in vision)
    run(tmp_path / "lora", family, family_paths, "trainer.max_steps=1", "model.lora.r=4", "trainer.eval_after=false")
    adapted = load_file(tmp_path / "lora" / "final" / "adapter_model.safetensors")
    assert adapted and not [k for k in adapted if any(f"{r}." in k for r in roots)]  # the tower has no adapter


def test_a_run_resumes_exactly_from_a_checkpoint(tmp_path, family_paths, family, two_steps):
    full_run = two_steps[0]  # evaluated after training: the weights it saved are the trained ones all the same
    run(tmp_path / "resumed", family, family_paths, "trainer.max_steps=2", "trainer.save_every=1",
        "trainer.keep_checkpoints=5", "trainer.eval_after=false", f"resume={full_run / 'checkpoint-1'}")
    full, resumed = weights(full_run / "final"), weights(tmp_path / "resumed" / "final")
    assert all(torch.equal(full[n], resumed[n]) for n in full)


def test_box_frames_are_declared_and_a_grounding_task_on_a_family_without_one_fails_in_one_sentence(family_paths):
    class Grounding:
        name, uses_boxes = "boxes", True

    for family, frame in FRAMES.items():
        policy = load_policy(str(family_paths[family]), family="auto", dtype="float32")
        assert policy.family.box_frame == frame
        if frame == "none":
            with pytest.raises(UserError, match="declares no box frame"):
                policy.family.require_box_frame(Grounding())
        else:
            policy.family.require_box_frame(Grounding())
            size = (200, 100, 64, 32)
            box = policy.family.to_original_frame(policy.family.to_model_frame((10, 20, 150, 90), size), size)
            assert box == pytest.approx((10, 20, 150, 90))


# ---- Qwen3.5's thinking mode --------------------------------------------------------------------
def test_qwen3_5_completions_start_inside_the_opened_think_block_and_are_scored_with_it(family_paths):
    policy = load_policy(str(family_paths["qwen3_5"]), family="auto", dtype="float32")
    question = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 48))},
                                             {"type": "text", "text": "Which colour?"}]}]
    prompts = policy.family.encode([question])
    assert prompts.texts[0].endswith("<|im_start|>assistant\n<think>\n")  # the template opened the block
    completion = "it is dark</think><answer>black</answer>"  # what the model writes from inside the block

    class Task:
        uses_boxes = False

    scored = in_task_frame(policy, Task(), [completion], prompts, 1)
    assert scored == ["<think>\n" + completion] and format_reward(scored[0]) == 1.0
    assert format_reward(completion) == 0.0  # without the opening the format reward would miss it
    # enable_thinking=false: the template's closed, empty block; the completion is the answer alone
    off = build_policy(load_config("train", ["model=tiny-qwen3.5", f"model.name_or_path={family_paths['qwen3_5']}",
                                             "model.enable_thinking=false"]).model, "cpu")
    closed = off.family.encode([question])
    assert closed.texts[0].endswith("assistant\n<think>\n\n</think>\n\n")
    assert in_task_frame(off, Task(), ["<answer>black</answer>"], closed, 1) == ["<answer>black</answer>"]


def test_moe_router_aux_loss_is_off_by_default_and_set_by_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("GPG_VL_CACHE", str(tmp_path))
    off = build_policy(load_config("train", ["model=tiny-qwen3.5-moe"]).model, "cpu")
    text = off.model.config.text_config
    assert text.router_aux_loss_coef == 0.0 and not text.output_router_logits
    on = build_policy(load_config("train", ["model=tiny-qwen3.5-moe", "model.router_aux_loss_coef=0.01"]).model, "cpu")
    assert on.model.config.text_config.router_aux_loss_coef == 0.01 and on.model.config.text_config.output_router_logits
    assert Path(off.name_or_path) == tmp_path / "tiny-qwen3_5_moe"


def test_moe_expert_weights_are_selectable_as_lora_targets(tmp_path, monkeypatch):
    monkeypatch.setenv("GPG_VL_CACHE", str(tmp_path))
    cfg = load_config("train", ["model=tiny-qwen3.5-moe", "model.lora.r=2",
                                "model.lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"])
    policy = build_policy(cfg.model, "cpu")
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert any("experts" in n and "lora" in n for n in trainable)


def test_moe_router_aux_loss_when_on_is_the_models_own_and_reaches_the_router(tmp_path, monkeypatch):
    monkeypatch.setenv("GPG_VL_CACHE", str(tmp_path))
    cfg = load_config("train", ["model=tiny-qwen3.5-moe", "model.router_aux_loss_coef=0.5"])
    policy = build_policy(cfg.model, "cpu")
    question = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 48))},
                                             {"type": "text", "text": "Which colour?"}]}]
    prompts = policy.family.encode([question])
    completion = torch.randint(20, 300, (1, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(completion, dtype=torch.bool)
    with torch.no_grad():  # sampling-like forwards are not recorded
        token_logps(policy.family, policy.model, prompts, [0], completion, mask, share_vision=False)
    assert router.router_aux_loss(policy.model) is None
    token_logps(policy.family, policy.model, prompts, [0], completion, mask, share_vision=False, share_prompt=False)
    ours = router.router_aux_loss(policy.model)
    # the completion's last token predicts nothing: the router loss leaves it out (the prompt-once path never
    # runs it); masking the last position changes no other position's output (causal attention)
    last_out = torch.cat([mask[:, :-1], torch.zeros_like(mask[:, -1:])], 1).long()
    full = {**prompts.inputs, "input_ids": torch.cat([prompts.inputs["input_ids"], completion], 1),
            "attention_mask": torch.cat([prompts.inputs["attention_mask"], last_out], 1),
            "mm_token_type_ids": torch.cat([prompts.inputs["mm_token_type_ids"], torch.zeros_like(completion)], 1)}
    reference = policy.model(**full).aux_loss  # transformers' own load-balancing loss on the same tokens
    torch.testing.assert_close(ours, 0.5 * reference)
    ours.backward()
    routers = [p.grad for n, p in policy.model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(g is not None and g.abs().sum() > 0 for g in routers)
    # a forward nobody weighed (the reference one above) is recorded too, every token counting; weighed by
    # its attention mask it gives the same loss as ours
    assert router.router_aux_loss(policy.model) is not None
    router.weigh_router_tokens(policy.model, lambda: full["attention_mask"])
    policy.model(**full)
    torch.testing.assert_close(router.router_aux_loss(policy.model), ours)
    assert router.router_aux_loss(policy.model) is None  # each forward's logits are used once


def test_moe_router_loss_leaves_padding_out_and_is_the_same_on_prompt_once_and_plain_paths(tmp_path, monkeypatch):
    from gpg_vl.models.router import router_balance_loss

    monkeypatch.setenv("GPG_VL_CACHE", str(tmp_path))
    policy = build_policy(load_config("train", ["model=tiny-qwen3.5-moe", "model.router_aux_loss_coef=1"]).model,
                          "cpu")
    questions = [[{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", size)},
                                               {"type": "text", "text": text}]}]
                 for size, text in (((64, 48), "Which colour?"), ((32, 32), "How many shapes are in the picture?"))]
    prompts = policy.family.encode(questions)  # two prompts of different lengths: left padding
    index = [0, 0, 1, 1]  # G = 2
    completion = torch.randint(20, 300, (4, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    losses, grads = [], []
    for share_prompt in (False, True):
        policy.model.zero_grad()
        token_logps(policy.family, policy.model, prompts, index, completion, mask, share_prompt=share_prompt,
                    share_vision=False)
        loss = router.router_aux_loss(policy.model)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for n, p in policy.model.named_parameters()
                                if n.endswith("mlp.gate.weight")]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    # hand-worked: two tokens, two experts, top-1; the padding row (weight 0) changes nothing
    logits = [torch.tensor([[2.0, 0.0], [0.0, 1.0], [9.0, -9.0]])]
    probs = torch.softmax(logits[0][:2], dim=-1)
    by_hand = 2 * ((0.5 * probs[:, 0].mean()) + (0.5 * probs[:, 1].mean()))
    torch.testing.assert_close(router_balance_loss(logits, [torch.tensor([1.0, 1.0, 0.0])], 2, 1), by_hand)
    weighted = router_balance_loss(logits, [torch.tensor([2.0, 1.0, 0.0])], 2, 1)  # row 0 counts twice
    twice = router_balance_loss([logits[0][[0, 0, 1]]], [None], 2, 1)
    torch.testing.assert_close(weighted, twice)
