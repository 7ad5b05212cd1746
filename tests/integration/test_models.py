"""The three model families on their tiny models: generation, training through the real trainer, box frames,
raw-text prompts for base models, and the memory options (LoRA, frozen vision tower, gradient checkpointing)."""

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import tiny_family_path
from helpers.scoring import token_logps
from PIL import Image
from transformers import AutoModelForImageTextToText

from gpg_vl.cli import build_policy, train_main
from gpg_vl.config.compose import load_config
from gpg_vl.errors import UserError
from gpg_vl.models.family import FAMILIES
from gpg_vl.models.load import load_policy
from gpg_vl.models.lora import LANGUAGE_LINEARS, apply_lora
from gpg_vl.models.qwen import Qwen3VLFamily
from gpg_vl.models.tiny import EMBEDDED_TINY
from gpg_vl.rollout.engine import Sampling
from gpg_vl.rollout.hf import generate

ROOT = Path(__file__).resolve().parents[2]
VOWELS = "task=helpers.vowel_task:Vowels"  # tests/ is on sys.path: one import, one registration
ALIASES = {"qwen2_vl": "tiny-qwen2-vl", "qwen2_5_vl": "tiny-qwen2.5-vl", "qwen3_vl": "tiny-qwen3-vl",
           "qwen3_vl_moe": "tiny-qwen3-vl-moe", "qwen3_5": "tiny-qwen3.5", "qwen3_5_moe": "tiny-qwen3.5-moe"}
QWEN = sorted(ALIASES)  # the Qwen families' tiny models (the generic ones are tested in test_generic.py)
CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
QUICK = ["trainer.batch_size=2", "trainer.group_size=4", "rollout.max_new_tokens=6", "trainer.eval_before=false",
         "trainer.eval_after=false", "trainer.beta_th=0"]


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """Each family's tiny model directory: the embedded Qwen2.5-VL, and the random others built here."""
    class Built(dict):  # each built the first time a test of this process reads it
        def __missing__(self, family):
            return tiny_family_path(family, tmp_path_factory)

    return Built()


def load(tiny_paths, family, **kwargs):
    torch.manual_seed(0)
    return load_policy(str(tiny_paths[family]), family=family, dtype="float32", min_pixels=3136, max_pixels=50176,
                       **kwargs)


def picture(i: int, size=(112, 84)) -> Image.Image:
    return Image.new("RGB", size, (30 + 70 * i, 200 - 60 * i, 90))


def question(image, text="What colour is it?"):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def run(tmp_path, *overrides):
    return train_main(load_config("train", [f"output_dir={tmp_path}", *QUICK, *overrides]))


def tiny_model(family, tiny_paths):
    return [f"model={ALIASES[family]}", f"model.name_or_path={tiny_paths[family]}"]


# ---- the families ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", QWEN)
def test_each_family_generates_and_its_images_reach_the_language_model(tiny_paths, family):
    policy = load(tiny_paths, family)
    assert type(policy.model).__name__ == CLASSES[family]
    prompts = policy.family.encode([question(picture(0)), question(picture(1))])
    patch = 16 if family.startswith("qwen3") else 14
    assert policy.family.image_patch_size == patch
    width, height = prompts.image_sizes[0][0][2:]
    assert width % (2 * patch) == 0 and height % (2 * patch) == 0  # resized to whole merged patches
    assert prompts.inputs["image_grid_thw"].tolist() == [[1, height // patch, width // patch]] * 2
    result = generate(policy, prompts, group_size=3, sampling=Sampling(max_new_tokens=5))
    assert result.completion_ids.shape == (6, 5) and len(result.texts) == 6
    # the same completions score differently under different images, and sharing the vision tower's
    # output over a group (DeepStack features included for Qwen3-VL) equals encoding per sequence
    index = [0, 0, 0, 1, 1, 1]
    shared = token_logps(policy.family, policy.model, prompts, index, result.completion_ids, result.completion_mask)
    repeated = token_logps(policy.family, policy.model, prompts, index, result.completion_ids,
                                          result.completion_mask, share_vision=False)
    torch.testing.assert_close(shared, repeated, rtol=1e-5, atol=1e-6)
    swapped = token_logps(policy.family, policy.model, prompts, [1, 1, 1, 0, 0, 0], result.completion_ids,
                                         result.completion_mask)
    assert not torch.allclose(shared, swapped)


@pytest.mark.parametrize("family", QWEN)
def test_each_family_trains_two_steps_through_the_trainer_and_every_parameter_changes(tmp_path, tiny_paths, family):
    before = {n: p.detach().clone() for n, p in
              AutoModelForImageTextToText.from_pretrained(tiny_paths[family]).named_parameters()}
    run(tmp_path, *tiny_model(family, tiny_paths), VOWELS, "trainer.max_steps=2", "trainer.lr=1e-2")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [0.0, 0.0]
    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "final")
    assert type(trained).__name__ == type(AutoModelForImageTextToText.from_pretrained(tiny_paths[family])).__name__
    unchanged = [n for n, p in trained.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


@pytest.mark.parametrize("family", QWEN)
def test_boxes_round_trip_between_original_pixels_and_the_model_frame(tiny_paths, family):
    policy = load(tiny_paths, family)
    prompts = policy.family.encode([question(picture(0, (333, 217)))])
    size = prompts.image_sizes[0][0]
    width, height, resized_width, resized_height = size
    assert (width, height) == (333, 217) and (resized_width, resized_height) != (333, 217)
    box = (12.0, 30.5, 301.0, 200.0)
    model_box = policy.family.to_model_frame(box, size)
    whole = policy.family.to_model_frame((0, 0, width, height), size)
    if family == "qwen2_5_vl":  # absolute pixels of the resized image
        assert whole == pytest.approx((0, 0, resized_width, resized_height))
    else:  # 0-1000, relative to the image
        assert whole == pytest.approx((0, 0, 1000, 1000))
    assert policy.family.to_original_frame(model_box, size) == pytest.approx(box, abs=1e-9)
    text = "<answer>[" + ", ".join(f"{v:.6f}" for v in model_box) + "]</answer>"
    assert policy.family.completion_to_original(text, [size]) == "<answer>[12, 30.5, 301, 200]</answer>"


# ---- base models: raw-text prompts ------------------------------------------------------------------
def test_base_model_aliases_use_raw_prompts_with_the_images_inline(tiny_paths):
    assert load_config("train", ["model=qwen2-vl-2b"]).model.prompt_style == "raw"
    assert load_config("train", ["model=qwen2-vl-2b-instruct"]).model.prompt_style == "chat"
    policy = load(tiny_paths, "qwen2_vl", prompt_style="raw", raw_template="Question: {prompt}\nAnswer:")
    text = policy.family.render(question(picture(0), "How many?"))
    assert text == "Question: <|vision_start|><|image_pad|><|vision_end|>How many?\nAnswer:"
    prompts = policy.family.encode([question(picture(0), "How many?")])
    ids = prompts.inputs["input_ids"][0]
    assert "<|im_start|>" not in policy.family.tokenizer.decode(ids)
    merged_tokens = int(prompts.inputs["image_grid_thw"][0].prod()) // 4
    assert int((ids == policy.model.config.image_token_id).sum()) == merged_tokens
    assert generate(policy, prompts, group_size=2, sampling=Sampling(max_new_tokens=4)).completion_ids.shape == (2, 4)
    default = load(tiny_paths, "qwen2_vl", prompt_style="raw").family.render(question(picture(0), "How many?"))
    assert default.startswith("A conversation between User and Assistant.") and default.endswith(
        "User: <|vision_start|><|image_pad|><|vision_end|>How many?\nAssistant:")


def test_prompt_style_mistakes_are_one_sentence(tiny_paths):
    with pytest.raises(UserError, match="model.prompt_style"):
        load(tiny_paths, "qwen2_vl", prompt_style="plain")
    with pytest.raises(UserError, match="placeholder"):
        load(tiny_paths, "qwen2_vl", prompt_style="raw", raw_template="Question: ")


# ---- aliases ----------------------------------------------------------------------------------------
HUB_ALIASES = {
    "qwen2-vl-2b": "Qwen/Qwen2-VL-2B", "qwen2-vl-2b-instruct": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2-vl-7b-instruct": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct", "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct", "qwen2.5-vl-72b": "Qwen/Qwen2.5-VL-72B-Instruct",
    **{f"qwen3-vl-{s}": f"Qwen/Qwen3-VL-{s.upper()}-Instruct" for s in ("2b", "4b", "8b")},
    **{f"qwen3-vl-{s}-{v}": f"Qwen/Qwen3-VL-{s.upper()}-{v.title()}" for s in ("2b", "4b", "8b")
       for v in ("instruct", "thinking")},
}


@pytest.mark.parametrize("alias", sorted(HUB_ALIASES))
def test_hub_aliases_name_their_model_family_and_the_papers_pixel_limit(alias):
    model = load_config("train", [f"model={alias}"]).model
    assert model.name_or_path == HUB_ALIASES[alias] and model.max_pixels == 401408 and model.dtype == "auto"
    assert model.family == {"Qwen2-": "qwen2_vl", "Qwen2.": "qwen2_5_vl", "Qwen3-": "qwen3_vl"}[
        model.name_or_path[5:11]]
    assert model.prompt_style == ("raw" if alias == "qwen2-vl-2b" else "chat")


def test_tiny_aliases_build_their_model_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPG_VL_CACHE", str(tmp_path))
    cfg = load_config("train", ["model=tiny-qwen3-vl"])
    policy = build_policy(cfg.model, "cpu")
    assert isinstance(policy.family, Qwen3VLFamily) and Path(policy.name_or_path) == tmp_path / "tiny-qwen3_vl"
    stamp = (tmp_path / "tiny-qwen3_vl" / "model.safetensors").stat().st_mtime_ns
    build_policy(cfg.model, "cpu")
    assert (tmp_path / "tiny-qwen3_vl" / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3_vl"]  # no partial build left behind
    tiny = load_config("train", ["model=tiny-qwen2.5-vl"]).model
    assert tiny == load_config("train", ["model=tiny"]).model


# ---- memory options ---------------------------------------------------------------------------------
def test_lora_targets_the_language_model_only_unless_the_vision_tower_is_asked_for(tiny_paths):
    # Qwen2.5-VL's vision MLP also has gate/up/down_proj layers: the default must still leave it alone
    loaded = load(tiny_paths, "qwen2_5_vl")
    model = apply_lora(loaded.model, r=4, alpha=8, vision_modules=loaded.family.vision_modules(loaded.model))
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert adapted and not [n for n in adapted if ".visual." in n]
    assert {n.rsplit(".", 1)[1] for n in adapted} == set(LANGUAGE_LINEARS)
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    policy = load(tiny_paths, "qwen2_5_vl")
    prompts = policy.family.encode([question(picture(0)), question(picture(1))])
    completion = torch.randint(20, 300, (4, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(completion, dtype=torch.bool)
    shared, repeated = (token_logps(policy.family, model, prompts, [0, 0, 1, 1], completion, mask, share_vision=s)
                        for s in (True, False))
    torch.testing.assert_close(shared, repeated, rtol=1e-5, atol=1e-6)  # the PEFT model shares its vision tower
    with_vision = apply_lora(load(tiny_paths, "qwen2_5_vl").model, r=4, alpha=8, include_vision=True)
    assert [n for n, _ in with_vision.named_parameters() if ".visual." in n and ".lora_A." in n]
    regex = apply_lora(load(tiny_paths, "qwen2_5_vl").model, r=4, alpha=8, target_modules=r".*\.self_attn\.q_proj")
    assert {n.split(".")[-4] for n, _ in regex.named_parameters() if ".lora_A." in n} == {"q_proj"}
    with pytest.raises(UserError, match="model.lora.target_modules"):
        apply_lora(load(tiny_paths, "qwen2_5_vl").model, r=4, alpha=8, target_modules=["no_such_layer"])


def test_lora_adapters_are_drawn_from_the_seed_and_leave_the_process_random_state_alone(tiny_paths):
    def adapters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}

    model = load(tiny_paths, "qwen2_5_vl").model
    state = torch.get_rng_state()
    first = adapters(apply_lora(model, r=4, alpha=8, seed=0))
    assert torch.equal(torch.get_rng_state(), state)  # what the process draws next is as without LoRA
    torch.manual_seed(99)  # the process's state does not matter: the seed does
    again = adapters(apply_lora(load(tiny_paths, "qwen2_5_vl").model, r=4, alpha=8, seed=0))
    other = adapters(apply_lora(load(tiny_paths, "qwen2_5_vl").model, r=4, alpha=8, seed=1))
    assert first and all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first)


def test_a_lora_run_trained_twice_with_one_seed_ends_with_the_same_adapters(tmp_path):
    from safetensors.torch import load_file

    common = ["model=tiny", VOWELS, "trainer.max_steps=2", "trainer.lr=1e-2", "model.lora.r=8", "seed=0"]
    run(tmp_path / "a", *common)
    run(tmp_path / "b", *common)
    a = load_file(tmp_path / "a" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "adapter_model.safetensors")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_lora_trains_its_adapter_only_and_saves_it_loadable_by_peft(tmp_path, tiny_paths, family):
    from peft import PeftModel
    from safetensors.torch import load_file

    base = AutoModelForImageTextToText.from_pretrained(tiny_paths[family])
    base_weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    run(tmp_path, *tiny_model(family, tiny_paths), VOWELS, "trainer.max_steps=2", "trainer.lr=1e-2",
        "model.lora.r=4", "trainer.share_vision=true", "trainer.gradient_checkpointing=true", "trainer.save_every=1")
    final = tmp_path / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "config.json").exists()
    # every LoRA tensor moves in step 2 (in step 1 the A matrices get no gradient: B starts at zero)
    step1 = load_file(tmp_path / "checkpoint-1" / "adapter_model.safetensors")
    step2 = load_file(final / "adapter_model.safetensors")
    assert step1 and step1.keys() == step2.keys() and not [k for k in step1 if torch.equal(step1[k], step2[k])]
    trained = PeftModel.from_pretrained(base, final)
    for name, value in trained.get_base_model().named_parameters():
        if ".lora_" not in name:
            assert torch.equal(value, base_weights[name.replace(".base_layer.", ".")]), name
    # evaluating the folder (no LoRA settings) loads base + adapter, merged
    cfg = load_config("eval", [f"model={final}"])
    policy = build_policy(cfg.model, "cpu")
    assert not hasattr(policy.model, "peft_config") and type(policy.family).__name__ == type(
        FAMILIES[family].__new__(FAMILIES[family])).__name__


def test_lora_merged_save_loads_with_transformers_alone_and_equals_the_adapter(tmp_path, tiny_paths):
    from peft import PeftModel

    run(tmp_path, "model=tiny", VOWELS, "trainer.max_steps=1", "trainer.lr=1e-2", "model.lora.r=4",
        "model.lora.save=merged")
    final = tmp_path / "final"
    merged = AutoModelForImageTextToText.from_pretrained(final)  # transformers alone
    with_adapter = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(EMBEDDED_TINY),
                                             final / "adapter")
    policy = load(tiny_paths, "qwen2_5_vl")
    prompts = policy.family.encode([question(picture(0)), question(picture(1))])
    completion = torch.randint(20, 300, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(completion, dtype=torch.bool)
    with torch.no_grad():
        a = token_logps(policy.family, merged, prompts, [0, 1], completion, mask)
        b = token_logps(policy.family, with_adapter, prompts, [0, 1], completion, mask)
        c = token_logps(policy.family, policy.model, prompts, [0, 1], completion, mask)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, c)  # and the adapter did change the model
    evaluated = build_policy(load_config("eval", [f"model={final}"]).model, "cpu").model  # the merged weights
    assert not hasattr(evaluated, "peft_config")
    assert all(torch.equal(p, merged.get_parameter(n)) for n, p in evaluated.named_parameters())


def test_lora_run_resumes_exactly_from_a_checkpoint(tmp_path, tiny_paths):
    from safetensors.torch import load_file

    common = [*tiny_model("qwen3_vl", tiny_paths), VOWELS, "trainer.max_steps=3", "trainer.save_every=1",
              "trainer.keep_checkpoints=5", "trainer.lr=1e-2", "model.lora.r=4", "model.lora.save=merged"]
    run(tmp_path / "full", *common)
    run(tmp_path / "resumed", *common, f"resume={tmp_path / 'full' / 'checkpoint-1'}")
    full = load_file(tmp_path / "full" / "final" / "adapter" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "final" / "adapter" / "adapter_model.safetensors")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    one = load_file(tmp_path / "full" / "checkpoint-1" / "adapter" / "adapter_model.safetensors")
    assert not all(torch.equal(full[k], one[k]) for k in full)


def test_frozen_vision_tower_is_not_trained_nor_in_the_optimizer(tmp_path, tiny_paths):
    before = {n: p.detach().clone() for n, p in
              AutoModelForImageTextToText.from_pretrained(tiny_paths["qwen2_vl"]).named_parameters()}
    run(tmp_path, *tiny_model("qwen2_vl", tiny_paths), VOWELS, "trainer.max_steps=1", "trainer.lr=1e-2",
        "model.freeze_vision=true", "trainer.save_every=1")
    trained = dict(AutoModelForImageTextToText.from_pretrained(tmp_path / "final").named_parameters())
    vision = [n for n in trained if ".visual." in f".{n}"]
    assert vision and all(torch.equal(trained[n], before[n]) for n in vision)
    assert all(not torch.equal(trained[n], before[n]) for n in trained if n not in vision)
    state = torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    assert len(state["optimizer"]["param_groups"][0]["params"]) == len(trained) - len(vision)


@pytest.mark.parametrize("family", QWEN)
def test_gradient_checkpointing_gives_the_same_gradient(tiny_paths, family):
    policy = load(tiny_paths, family)
    prompts = policy.family.encode([question(picture(0)), question(picture(1))])
    completion = torch.randint(20, 300, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(completion, dtype=torch.bool)
    policy.model.train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            policy.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            layers = [m for m in policy.model.modules() if hasattr(m, "gradient_checkpointing")]
            assert layers and all(m.gradient_checkpointing for m in layers)  # language model and vision tower
        policy.model.zero_grad()
        logps = token_logps(policy.family, policy.model, prompts, [0, 0, 1, 1], completion, mask)
        logps.sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(policy.model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_zero3_offload_launch_config_offloads_parameters_and_optimizer_to_cpu():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / "accelerate" / "zero3_offload.yaml"))
    assert config.distributed_type == "DEEPSPEED"
    ds = config.deepspeed_config
    assert ds["zero_stage"] == 3 and ds["offload_param_device"] == "cpu" and ds["offload_optimizer_device"] == "cpu"
