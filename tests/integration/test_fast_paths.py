"""The throughput paths change where work is done, never the maths: each is checked against the plain path.

- one update's gradient with every fast path on equals the gradient with all of them off;
- prompt-once prefill gives the same greedy tokens as prefilling every row;
- the chunked log-softmax equals the plain one, in value and gradient;
- token-budget micro-batches cover each valid sequence exactly once and respect the budget.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from helpers import procs
from helpers.gradients import (
    FAMILIES,
    assert_fast_paths_give_the_plain_gradient,
    lora_policy,
    mixed_attempt,
    mixed_prompts,
    one_update_gradient,
)
from helpers.once import once
from helpers.runs import tiny_family_policy
from helpers.scoring import path_for
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import get_scheduler

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.models.batch import PromptBatch
from gpg_vl.models.cache import ReservedLayer, reserve
from gpg_vl.models.logits import completion_logps
from gpg_vl.rollout.engine import Sampling
from gpg_vl.rollout.hf import DECODERS, generate
from gpg_vl.rollout.types import Rollout
from gpg_vl.train.step.micro_batch import micro_batch_cost, update_chunks
from gpg_vl.train.step.sample import Attempt
from gpg_vl.train.step.update import Learner, update


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    """A float32 tiny model of each family: the embedded Qwen2.5-VL, the random others built here."""
    return tiny_family_policy(request.param, tmp_path_factory)


def test_one_update_gradient_with_every_fast_path_equals_the_plain_update(family_policy, shapes):
    assert_fast_paths_give_the_plain_gradient(family_policy, mixed_attempt(family_policy, shapes))


def test_fast_paths_run_the_lora_adapters_and_give_their_plain_gradient(policy, shapes):
    wrapped = lora_policy(policy)
    assert_fast_paths_give_the_plain_gradient(wrapped, mixed_attempt(wrapped, shapes))


@pytest.mark.parametrize("lora", [False, True])
def test_the_sharded_engine_path_gives_the_fast_paths_gradient(policy, shapes, monkeypatch, lora):
    """Under FSDP / ZeRO-3 (forward_is_collective) token_logps runs whole sequences through the wrapped
    model, its images encoded inside that forward (a hook, on the LoRA tuner under PEFT): same gradient."""
    import gpg_vl.distributed

    subject = lora_policy(policy) if lora else policy
    attempt = mixed_attempt(subject, shapes)
    settings = TrainerSettings(max_grad_norm=1e9, group_size=3, micro_batch_tokens=110)
    fast = one_update_gradient(subject, attempt, settings)
    hooked = []
    monkeypatch.setattr(gpg_vl.distributed, "forward_is_collective", lambda model: hooked.append(model) or True)
    sharded = one_update_gradient(subject, attempt, settings)
    assert hooked  # the sharded path ran
    torch.testing.assert_close(sharded, fast, rtol=1e-4, atol=1e-5 * float(fast.abs().max()))


def test_prompt_once_prefill_gives_the_same_greedy_tokens(family_policy, shapes):
    policy = family_policy
    prompts = mixed_prompts(policy, shapes)
    group_size = 2
    declined = policy.family.prefill_once_unsupported(policy.model)
    if declined is not None:  # the family steps aside (said once, in its one-line description)
        assert type(policy.model).__name__ in ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration") \
            and "sliding-window" in declined, declined
        assert declined in policy.family.describe(policy.model)
        return
    greedy = Sampling(max_new_tokens=12, greedy=True)
    # the reference: transformers' generate prefilling every one of the B * G rows
    every_row = generate(policy, prompts.select([i // group_size for i in range(3 * group_size)]), group_size=1,
                         sampling=greedy, prefill_once=False, decode="generate")
    for decode in DECODERS:  # gpg-vl's decode loop (the default) and generate, both on the forked prompt cache
        for static_cache, reserve_cache in ((False, False), (False, True), (True, False)):  # dynamic, reserved, static
            once = generate(policy, prompts, group_size=group_size, sampling=greedy, prefill_once=True,
                            static_cache=static_cache, reserve_cache=reserve_cache, decode=decode)
            assert torch.equal(once.completion_ids, every_row.completion_ids), (decode, static_cache, reserve_cache)
            assert torch.equal(once.completion_mask, every_row.completion_mask)
    assert policy.family.position_ids(policy.model, prompts.inputs).shape[-2] == 3  # stale rope deltas are reset


def rollout_and_update_logps(policy, prompts, *, group_size: int, decode: str, steps: int = 10):
    """(the log-probs the rollout sampled each token with, read off the logits of each sampling forward;
    the update's log-probs of the same tokens; the completion mask)."""
    from helpers.scoring import token_logps

    rows, seen = prompts.inputs["input_ids"].shape[0] * group_size, []

    def record(_module, _inputs, output):
        if output.logits.shape[0] == rows:  # a sampling forward (the prompts' own prefill has B rows)
            seen.append(output.logits[:, -1].float())

    hook = policy.model.register_forward_hook(record)
    torch.manual_seed(0)
    try:  # sampled at temperature 1 (transformers' generate samples G > 1 greedy rows of a prompt only alike)
        rollout = generate(policy, prompts, group_size=group_size, sampling=Sampling(max_new_tokens=steps),
                           decode=decode)
    finally:
        hook.remove()
    ids, mask = rollout.completion_ids, rollout.completion_mask  # [N, C]
    logits = torch.stack(seen[:ids.shape[1]], dim=1)  # [N, C, V]
    sampled = policy.family.logps_from_logits(logits, ids).float()  # [N, C], suppressed ids left out, as sampled
    index = [i // group_size for i in range(rows)]
    with torch.no_grad():  # the plain path (every fast path gives its log-probs: the tests above)
        updated = token_logps(policy.family, policy.model, prompts, index, ids, mask, share_vision=False).float()
    return sampled, updated, mask


@pytest.mark.parametrize("decode", DECODERS)
def test_the_rollouts_and_the_updates_log_probs_agree_on_left_padded_prompts(family_policy, shapes, decode):
    """Every family, prompts of three lengths (two left-padded): the prefill runs at the attention mask's positions,
    as the decode steps and the update do (tiny SmolVLM differed by 4.4e-3 when the prefill counted the padding)."""
    policy = family_policy
    prompts = mixed_prompts(policy, shapes)
    sampled, updated, mask = rollout_and_update_logps(policy, prompts, group_size=2, decode=decode)
    gap = float(((sampled - updated).abs() * mask).max())
    assert gap < 2e-5, (policy.family.name, gap)


def test_a_reserved_cache_layer_gives_what_a_dynamic_layer_gives_without_copying_per_token():
    from transformers import DynamicCache, DynamicLayer

    torch.manual_seed(0)
    prompt_keys, prompt_values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)  # [N, heads, S, d]
    cache = DynamicCache()
    cache.update(prompt_keys, prompt_values, 0)
    dynamic = DynamicLayer()
    dynamic.update(prompt_keys, prompt_values)
    reserve(cache, capacity=8)
    reserved = cache.layers[0]
    assert isinstance(reserved, ReservedLayer) and reserved.get_seq_length() == 5
    storage = reserved.keys.data_ptr()
    for length in (1, 1, 1):  # three decoded tokens fill the room exactly
        step = torch.randn(3, 2, length, 4), torch.randn(3, 2, length, 4)
        expected, got = dynamic.update(*step), reserved.update(*step)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        assert got[0].data_ptr() == storage  # written in place: a view of the reserved room
    assert reserved.get_seq_length() == 8 and reserved.get_mask_sizes(1) == dynamic.get_mask_sizes(1) == (9, 0)
    step = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)  # past the room: grows by concatenation
    assert torch.equal(dynamic.update(*step)[0], reserved.update(*step)[0]) and reserved.get_seq_length() == 9
    # reordered from outside (a new tensor): it keeps growing as a dynamic layer, with the same values
    order = torch.tensor([2, 0, 1])
    dynamic.reorder_cache(order), reserved.reorder_cache(order)
    step = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(dynamic.update(*step), reserved.update(*step), strict=True))
    # cropped: the next token overwrites the cropped positions of the room, as the dynamic layer forgets them
    layer = ReservedLayer(prompt_keys, prompt_values, capacity=8)
    plain = DynamicLayer()
    plain.update(prompt_keys, prompt_values)
    layer.crop(-2), plain.crop(-2)
    step = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain.update(*step), layer.update(*step), strict=True))
    assert layer.get_seq_length() == 4
    # a state that needs a gradient is never written into the room in place
    layer = ReservedLayer(prompt_keys, prompt_values, capacity=8)
    wanted = torch.randn(3, 2, 1, 4, requires_grad=True)
    keys, _ = layer.update(wanted, wanted)
    keys.sum().backward()
    assert torch.equal(wanted.grad, torch.ones_like(wanted))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_log_softmax_equals_the_plain_one_in_value_and_gradient(temperature):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)  # [N, C, H]
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64, requires_grad=True)  # [V, H]
    tokens = torch.randint(0, 9, (3, 5), generator=generator)  # never a suppressed id (9, 10)
    mask = torch.rand(3, 5, generator=generator) > 0.3
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)

    logits = (hidden @ weight.T).index_fill(-1, torch.tensor([9, 10]), float("-inf")) / temperature
    plain = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask  # [N, C]
    plain_grads = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    chunked = completion_logps(hidden, weight, tokens, mask, suppressed_ids=[9, 10], temperature=temperature,
                               chunk_tokens=4)
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    assert chunked.dtype == torch.float32 or chunked.dtype == torch.float64
    torch.testing.assert_close(chunked.double(), plain, rtol=1e-6, atol=1e-6)
    for fast, slow in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def fake_attempt(prompt_lengths: list[int], completion_lengths: list[int], valid: list[bool], group_size: int):
    """An attempt with only what update_chunks reads: prompt masks, completion masks, advantages."""
    width, count = max(prompt_lengths), len(prompt_lengths)
    attention = torch.arange(width)[None, :] >= width - torch.tensor(prompt_lengths)[:, None]  # left padding
    prompts = PromptBatch({"input_ids": torch.zeros(count, width, dtype=torch.long),
                           "attention_mask": attention.long()}, [0] * count)
    lengths = torch.tensor(completion_lengths)
    mask = torch.arange(max(completion_lengths))[None, :] < lengths[:, None]
    sequence_id = torch.arange(count * group_size, dtype=torch.float32)  # the advantage names the sequence
    return Attempt([{}] * count, prompts, Rollout(mask.long(), mask, [""] * len(lengths), group_size),
                   torch.zeros(count, group_size), {}, sequence_id.view(count, group_size), torch.tensor(valid))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), group_size=st.integers(1, 5), groups=st.integers(1, 5), budget=st.integers(1, 400),
       share_prompt=st.booleans())
def test_token_budget_micro_batches_cover_each_valid_sequence_once_within_the_budget(data, group_size, groups,
                                                                                     budget, share_prompt):
    prompt_lengths = data.draw(st.lists(st.integers(1, 60), min_size=groups, max_size=groups))
    completion_lengths = data.draw(st.lists(st.integers(0, 30), min_size=groups * group_size,
                                            max_size=groups * group_size))
    valid = data.draw(st.lists(st.booleans(), min_size=groups, max_size=groups))
    attempt = fake_attempt(prompt_lengths, [max(n, 1) if i == 0 else n for i, n in enumerate(completion_lengths)],
                           valid, group_size)
    lengths = attempt.rollout.completion_mask.sum(dim=1)
    seen = []
    for chunk in update_chunks([attempt], 0, budget, share_prompt=share_prompt):
        prompt_index, mask, adv = chunk.prompt_index, chunk.completion_mask, chunk.advantages
        sequences = adv.long().tolist()
        seen += sequences
        assert prompt_index == [s // group_size for s in sequences]
        assert torch.equal(mask.sum(dim=1), lengths[sequences])  # trimmed, nothing of a sequence lost
        assert mask.shape[1] == max(int(lengths[sequences].max()), 1)  # no column that is padding everywhere
        cost = micro_batch_cost([prompt_lengths[p] for p in prompt_index], prompt_index,
                                lengths[sequences].tolist(), share_prompt=share_prompt)
        assert cost <= budget or len(sequences) == 1
    expected = [b * group_size + g for b in range(groups) if valid[b] for g in range(group_size)]
    assert sorted(seen) == expected


def test_micro_batch_cost_counts_padding_and_shared_prompts():
    # prompts of 10 and 4 tokens (padded to 10), completions of 3, 5, 2 tokens (padded to 5)
    assert micro_batch_cost([10, 10, 4], [0, 0, 1], [3, 5, 2], share_prompt=False) == 3 * 10 + 3 * 5
    assert micro_batch_cost([10, 10, 4], [0, 0, 1], [3, 5, 2], share_prompt=True) == 2 * 10 + 3 * 5


# ----------------------------------------------------------------------------- several processes
def _two_group_attempt(policy, shapes, rank: int, valid: list[bool]) -> Attempt:
    rows = shapes.load("train")[2 * rank:2 * rank + 2]
    prompts = policy.family.encode([shapes.messages(row) for row in rows])
    ids = torch.randint(20, 300, (4, 5), generator=torch.Generator().manual_seed(rank))  # [b * G, C]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 3:] = False
    advantages = torch.tensor([[0.5, -0.5], [0.3, -0.3]])
    return Attempt([{}] * 2, prompts, Rollout(ids, mask, [""] * 4, 2), advantages, {}, advantages,
                   torch.tensor(valid))


def _weight_change(attempts_of, share_prompt: bool, accelerator: Accelerator) -> torch.Tensor:
    """One SGD(lr=1) update of the tiny model on this process's attempts; returns the change of every weight."""
    from gpg_vl import get_task
    from gpg_vl.models.load import Policy, load_policy

    policy = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=50176)
    attempts = attempts_of(policy, get_task("shapes", train_size=8, test_size=2))
    settings = TrainerSettings(group_size=2, share_prompt=share_prompt, logits_chunk_tokens=4 if share_prompt else 0,
                               max_grad_norm=1e9)
    policy.model.train()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    model, optimizer, scheduler = accelerator.prepare(policy.model, optimizer, get_scheduler("constant", optimizer))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    update(Learner(Policy(accelerator.unwrap_model(model), policy.processor, policy.family, "tiny"), model,
                   optimizer, scheduler, accelerator, settings, temperature=1.0,
                   path=path_for(policy.family, model, settings)), attempts)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


VALID_ON_RANK_1 = {"one-valid": [True, False], "none-valid": [False, False]}
TWO_PROCESS_CASES = [(share_prompt, name) for name in VALID_ON_RANK_1 for share_prompt in (True, False)]


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """Each case of TWO_PROCESS_CASES in turn, in one pair of processes (one start, one process group)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    for share_prompt, name in TWO_PROCESS_CASES:
        valid = [True, True] if rank == 0 else VALID_ON_RANK_1[name]
        change = _weight_change(lambda policy, shapes, valid=valid: [_two_group_attempt(policy, shapes, rank, valid)],
                                share_prompt, Accelerator(cpu=True))
        torch.save(change, f"{out}/{name}-{share_prompt}-rank{rank}.pt")


@pytest.fixture(scope="module")
def two_process_changes(tmp_path_factory):
    """The folder of each rank's weight change in every case, from 2 processes started once for all the cases
    (and once per test run: helpers/once.py)."""
    import socket

    import torch.multiprocessing as mp

    def make(out: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        procs.context()  # forked from a process that imported torch once (helpers/procs.py)
        workers = mp.start_processes(_ddp_worker, args=(port, str(out)), nprocs=2, start_method="forkserver",
                                     join=False)
        deadline = time.monotonic() + 150 * len(TWO_PROCESS_CASES)
        while not workers.join(timeout=5):  # a collective one process never joins would hang: fail instead
            if time.monotonic() > deadline:
                for process in workers.processes:
                    process.terminate()
                pytest.fail("the two processes did not finish their updates in time (a hung all-reduce)")

    return once(tmp_path_factory, "two-processes", make)


@pytest.mark.slow
@pytest.mark.parametrize(("share_prompt", "valid_on_rank_1"), TWO_PROCESS_CASES,
                         ids=[f"{name}-{share_prompt}" for share_prompt, name in TWO_PROCESS_CASES])
def test_two_processes_update_as_one_process_on_all_their_sequences(two_process_changes, share_prompt,
                                                                    valid_on_rank_1):
    """Gradients are averaged over processes explicitly, also when a process has no valid sequence (no forward)."""
    single = _weight_change(lambda policy, shapes: [_two_group_attempt(policy, shapes, 0, [True, True]),
                                                    _two_group_attempt(policy, shapes, 1,
                                                                       VALID_ON_RANK_1[valid_on_rank_1])],
                            share_prompt, Accelerator(cpu=True))
    ranks = [torch.load(two_process_changes / f"{valid_on_rank_1}-{share_prompt}-rank{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0], ranks[1])
    torch.testing.assert_close(ranks[0], single, rtol=1e-5, atol=1e-6 * float(single.abs().max()))


@pytest.mark.parametrize("engine", ["gradient_checkpointing", "sharded"])
def test_the_scoring_path_is_chosen_once_and_micro_batches_keep_the_token_budget_of_the_path_taken(policy, shapes,
                                                                                                   monkeypatch, engine):
    """Where prompt-once steps aside (gradient checkpointing, FSDP / ZeRO-3), the forward runs whole sequences,
    and the micro-batches are cut by the cost of whole sequences: none holds more than trainer.micro_batch_tokens."""
    import gpg_vl.distributed
    from gpg_vl.models.scoring import choose_scoring_path

    if engine == "gradient_checkpointing":
        policy.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        monkeypatch.setattr(gpg_vl.distributed, "forward_is_collective", lambda model: True)
    path = choose_scoring_path(policy.family, policy.model, share_prompt=True, share_vision=True)
    assert not path.prompt_once and path.shared_vision and path.wrapped == (engine == "sharded")
    attempt = mixed_attempt(policy, shapes)
    prompt_lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1).tolist()
    budget = int(max(prompt_lengths)) + 8
    chunks = list(update_chunks([attempt], 0, budget, share_prompt=path.prompt_once))
    for chunk in chunks:
        prompt_index, mask = chunk.prompt_index, chunk.completion_mask
        whole = micro_batch_cost([prompt_lengths[p] for p in prompt_index], prompt_index, mask.sum(dim=1).tolist(),
                                 share_prompt=False)
        assert whole <= budget or len(prompt_index) == 1
    # counted as prompt-once, the same budget would have packed a group's sequences together, over the budget
    packed = list(update_chunks([attempt], 0, budget, share_prompt=True))
    assert len(packed) < len(chunks)
