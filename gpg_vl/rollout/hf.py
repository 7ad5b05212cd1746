"""The Hugging Face engine: B prompts (images + text) -> B x G completions, sampled by the trained model itself.

Vision special tokens are suppressed during sampling (and, by the family, in the update's log-probs), so
they are never generated and never fed back as image placeholders. A completion's mask covers its tokens
up to and including the first end-of-sequence token.

Two decoders (`rollout.hf.decode`), the same tokens:

- `loop` (default): each prompt is prefilled once and its cache forked G ways (`models/cache.py`), then a
  plain loop calls the bare model's forward one token at a time, with the positions of the whole
  sequence computed once up front by the family and the attention mask preallocated; the logits are
  processed exactly as `generate` processes them (suppressed ids at -inf, temperature, top-p, then
  `torch.multinomial`, or argmax for greedy). Where the loop cannot run exactly (collective generation
  under FSDP / ZeRO-3, a family whose prompt cannot be forked, a prompt that cannot be split) it steps
  aside for `generate`;
- `generate`: transformers' `generate`, with the prefill-once fork where the family allows it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from gpg_vl.distributed import forward_is_collective, gathered_for_generation
from gpg_vl.errors import UserError
from gpg_vl.models.batch import PromptBatch, eval_mode, extend_per_token, unwrap
from gpg_vl.models.cache import cache_keyword, prefill_once
from gpg_vl.models.load import Policy
from gpg_vl.rollout.engine import Engine, EnginePrompts, Sampling, register_engine
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.sampling import next_tokens, process_logits  # noqa: F401  (process_logits re-exported)
from gpg_vl.rollout.settings import HFEngineSettings
from gpg_vl.rollout.types import Rollout, completion_mask_from_eos

DECODERS = ("loop", "generate")


@register_engine
class HFEngine(Engine):
    """Samples with `policy.model`: nothing to sync (the sampler is the trained model), no sleep mode."""

    name = "hf"
    settings_class = HFEngineSettings
    multi_turn = True
    returns_logps = True  # each sampled token's log-prob at the sampling temperature (`behaviour_logps`)

    def __init__(self, policy: Policy, rollout, *, accelerator=None) -> None:
        self.policy, self.settings = policy, HFEngine.settings_in(rollout)  # rollout.hf, in a subclass too

    def take_tools(self, settings: MultiTurnSettings, tools: tuple[str, ...]) -> None:
        settings = replace(settings, hf_multiturn=self.settings.multiturn)  # rollout.hf.multiturn
        if settings.multi_turn:
            from gpg_vl.rollout.multiturn.decoding import require_multi_turn

            require_multi_turn(self.policy.family, self.policy.model, settings)
        super().take_tools(settings, tools)

    @classmethod
    def unavailable(cls, rollout) -> str | None:
        decode = HFEngine.settings_in(rollout).decode
        if decode not in DECODERS:
            return f"unknown rollout.hf.decode {decode!r}; use one of {', '.join(DECODERS)}."
        return None

    def generate(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        if self.multiturn.multi_turn:
            from gpg_vl.rollout.multiturn.decoding import generate_trajectories

            return generate_trajectories(self.policy, prompts, group_size=group_size, sampling=sampling,
                                         settings=self.multiturn, tools=self.tools)
        return generate(self.policy, prompts.batch, group_size=group_size, sampling=sampling,
                        prefill_once=self.settings.prefill_once, static_cache=self.settings.static_cache,
                        reserve_cache=self.settings.reserve_cache, decode=self.settings.decode)


@torch.no_grad()
def generate(policy: Policy, prompts: PromptBatch, *, group_size: int, sampling: Sampling, prefill_once: bool = True,
             static_cache: bool = False, reserve_cache: bool = True, decode: str = "loop") -> Rollout:
    """Sample `group_size` completions for every prompt (see the module's docstring for the two decoders).

    With `prefill_once`, each prompt (images included) is prefilled once and its key/value cache forked
    G ways, instead of prefilling every one of the B * G rows; `static_cache` preallocates that cache as
    transformers' StaticCache (attention then spans the whole preallocated length), `reserve_cache` keeps it
    dynamic with room reserved for the whole completion (attention spans the tokens so far, and the cache
    is not copied per token). Under FSDP / ZeRO-3 with several processes (generation is
    collective there) the rows are prefilled by `generate` itself, in step.
    """
    if decode not in DECODERS:
        raise UserError(f"unknown rollout.hf.decode {decode!r}; use one of {', '.join(DECODERS)}.")
    family, model = policy.family, policy.model
    inputs = prompts.to(model.device).inputs
    family.reset_positions(unwrap(model))  # rotary offsets an earlier generate cached for its own batch
    collective = forward_is_collective(model)
    forkable = prefill_once and not collective and family.prefill_once_unsupported(model) is None
    suppress = list(family.suppressed_ids) + (list(family.eos_ids) if sampling.ignore_eos else [])
    completion_ids = None
    if forkable and decode == "loop":
        with eval_mode(model):
            completion_ids = decode_loop(family, model, inputs, group_size=group_size, sampling=sampling,
                                         suppress=suppress, static_cache=static_cache, reserve_cache=reserve_cache)
    if completion_ids is None:
        completion_ids = _generate(family, model, inputs, group_size=group_size, sampling=sampling,
                                   suppress=suppress, fork=forkable and group_size > 1, static_cache=static_cache,
                                   reserve_cache=reserve_cache, collective=collective)
    completion_ids, logps = completion_ids  # [B * G, C] each: the ids and their behaviour log-probs
    if completion_ids.shape[1] == 0:
        completion_ids = torch.full((completion_ids.shape[0], 1), family.pad_id, dtype=completion_ids.dtype,
                                    device=completion_ids.device)
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    mask = completion_mask_from_eos(completion_ids, family.eos_ids, ignore_eos=sampling.ignore_eos)  # [B * G, C]
    completion_ids = completion_ids.masked_fill(~mask, family.pad_id)  # [B * G, C]
    texts = family.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(completion_ids=completion_ids, completion_mask=mask, texts=texts, group_size=group_size,
                   sampler_logps=logps.float().masked_fill(~mask, 0.0))


def behaviour_logps(family, logits: Tensor, chosen: Tensor, sampling: Sampling) -> Tensor:
    """The log-prob [N] of each sampled token `chosen` [N] under the distribution it was drawn from: logits [N, V]
    at the sampling temperature, suppressed ids removed, as the update scores it (`Family.logps_from_logits`)."""
    temperature = 1.0 if sampling.greedy else sampling.temperature
    return family.logps_from_logits(logits.unsqueeze(1), chosen.unsqueeze(1), temperature=temperature)[:, 0].float()


def _generate(family, model, inputs: dict[str, Tensor], *, group_size: int, sampling: Sampling, suppress: list[int],
              fork: bool, static_cache: bool, reserve_cache: bool, collective: bool) -> tuple[Tensor, Tensor]:
    """(completion ids [B * G, C], their behaviour log-probs [B * G, C]) from transformers' `generate` (after the
    prefill-once fork with `fork`); the log-probs from the raw logits it returns (`output_logits`)."""
    expand, forked = group_size, None
    if fork:
        with eval_mode(model):
            forked = prefill_once(family, model, inputs, group_size=group_size,
                                         max_new_tokens=sampling.max_new_tokens, static_cache=static_cache,
                                         reserve_cache=reserve_cache)
    width = inputs["input_ids"].shape[1]
    if forked is not None:
        inputs, expand = forked, 1
    else:
        positions = family.position_ids(unwrap(model), inputs)  # multimodal: the family's, not the model's own rule
        if positions is not None and positions.dim() == 3:
            inputs = {**inputs, "position_ids": positions}  # [3, B, P]: generate extends them one per new token
        if static_cache:
            inputs = {**inputs, "cache_implementation": "static"}
    how = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if sampling.greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    # Under FSDP / ZeRO-3 generation is collective: synced_gpus keeps every process decoding until all are done.
    with eval_mode(model), gathered_for_generation(model):
        output = model.generate(
            **inputs, max_new_tokens=sampling.max_new_tokens, num_return_sequences=expand,
            suppress_tokens=suppress or None, eos_token_id=family.eos_ids, pad_token_id=family.pad_id,
            synced_gpus=collective, output_logits=True, return_dict_in_generate=True, **how,
        )
    ids = output.sequences[:, width:]  # [B * G, C]
    if not output.logits:
        return ids, torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    logits = torch.stack(output.logits, dim=1).float()  # [B * G, C, V]
    temperature = 1.0 if sampling.greedy else sampling.temperature
    return ids, family.logps_from_logits(logits, ids, temperature=temperature)  # [B * G, C]


# ---------------------------------------------------------------------------------------------
# the decode loop
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_loop(family, model, inputs: dict[str, Tensor], *, group_size: int, sampling: Sampling,
                suppress: list[int], static_cache: bool, reserve_cache: bool) -> tuple[Tensor, Tensor] | None:
    """(completion ids [B * G, C], their behaviour log-probs [B * G, C]: `behaviour_logps`) sampled one token at
    a time on the prompts' forked cache, or None where the prompts cannot be prefilled once (then `generate`
    decodes them).

    Per token: one forward of the bare model on the B * G last tokens (positions and attention mask sliced
    from tensors built once), then `next_tokens` on its last logits. Rows that have produced an EOS
    continue with the pad token, and the loop ends when every row has (as `generate` does).
    """
    bare = unwrap(model)
    steps = sampling.max_new_tokens
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]  # [B, P]
    batch, width = prompt_ids.shape
    filler = prompt_ids.new_full((batch, steps), family.pad_id)
    positions = family.position_ids(bare, extend_per_token(inputs, filler, prompt_mask.new_ones(batch, steps)))
    if positions is None:  # the model computes its own positions from the whole multimodal sequence
        return None
    forked = prefill_once(family, bare, inputs, group_size=group_size, max_new_tokens=steps,
                                 static_cache=static_cache, reserve_cache=reserve_cache)
    if forked is None:
        return None
    index = torch.arange(batch, device=prompt_ids.device).repeat_interleave(group_size)  # [N]
    positions = positions.index_select(-2, index)  # [..., N, P + C]
    rows = batch * group_size
    attention = torch.cat([forked["attention_mask"], prompt_mask.new_ones(rows, steps)], dim=1)  # [N, P + C]
    suppressed = torch.tensor(suppress, device=prompt_ids.device) if suppress else None
    eos = torch.tensor(family.eos_ids, device=prompt_ids.device) if family.eos_ids and not sampling.ignore_eos \
        else None
    keyword = cache_keyword(bare)  # `cache` (transformers >= 5.24) or `past_key_values`
    cache, token = forked[keyword], forked["input_ids"][:, -1:]  # [N, 1]: the prompt's last token
    out = prompt_ids.new_full((rows, steps), family.pad_id)  # [N, C]
    logps = torch.zeros((rows, steps), dtype=torch.float32, device=prompt_ids.device)  # [N, C]
    unfinished = torch.ones(rows, dtype=torch.bool, device=prompt_ids.device)  # [N]
    done = 0
    for step in range(steps):
        at = width - 1 + step
        logits = bare(input_ids=token, attention_mask=attention[:, :at + 1], position_ids=positions[..., at:at + 1],
                      use_cache=True, logits_to_keep=1, **{keyword: cache}).logits[:, -1].float()  # [N, V]
        chosen = next_tokens(logits, sampling, suppressed)  # [N]
        chosen = torch.where(unfinished, chosen, torch.full_like(chosen, family.pad_id))
        out[:, step] = chosen
        logps[:, step] = behaviour_logps(family, logits, chosen, sampling)
        done = step + 1
        if eos is not None:
            unfinished &= ~torch.isin(chosen, eos)
            if not bool(unfinished.any()):
                break
        token = chosen.unsqueeze(1)
    return out[:, :done], logps[:, :done]
