"""What the two vLLM engines share (`colocated` and `server`): the base class (their on-policy check and its
warning, the refusal of multi-turn on a family that cannot run it), the sampling fields both send vLLM, and the
rollout made from each completion's tokens and sampler log-probs."""

from __future__ import annotations

import torch

from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Correction, Engine, Sampling, logp_mismatch_warning
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.types import Rollout, completion_mask_from_eos

BANNED_BIAS = -100.0  # vLLM clamps logit biases to [-100, 100]: a banned token's probability is exp(-100) of others


def sampling_fields(family, sampling: Sampling, n: int, max_tokens: int | None = None) -> dict:
    """The fields of vLLM's SamplingParams both engines set alike: n completions, sampled as the HF engine samples
    (greedy: temperature 0, top_k 1), each sampled token's log-prob (`logprobs=0`), EOS as the stop."""
    return {
        "n": n, "max_tokens": max_tokens or sampling.max_new_tokens, "logprobs": 0,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": 1 if sampling.greedy else -1,
        "ignore_eos": sampling.ignore_eos, "stop_token_ids": [] if sampling.ignore_eos else list(family.eos_ids),
    }


def banned_tokens(family, sampling: Sampling) -> list[int]:
    """The token ids vLLM must not sample, in order: the family's suppressed ids (vision tokens), and EOS with
    ignore-EOS."""
    return sorted(set(list(family.suppressed_ids) + (list(family.eos_ids) if sampling.ignore_eos else [])))


def padded_rollout(family, rows: list[list[int]], logps: list[list[float]], sampling: Sampling, group_size: int,
                   device) -> Rollout:
    """The rollout of B * G completions (`rows`: token ids; `logps`: the sampler's log-prob of each), right-padded
    with the pad id (log-prob 0), cut after EOS (unless ignore-EOS), decoded, on `device`."""
    pad = family.pad_id
    width = max([len(row) for row in rows] + [1])
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B * G, C]
    sampler = torch.zeros((len(rows), width), dtype=torch.float32)  # [B * G, C]
    for n, (row, row_logps) in enumerate(zip(rows, logps, strict=True)):
        ids[n, :len(row)] = torch.tensor(row, dtype=torch.long)
        sampler[n, :len(row)] = torch.tensor(row_logps, dtype=torch.float32)
    mask = completion_mask_from_eos(ids, family.eos_ids, ignore_eos=sampling.ignore_eos)  # [B * G, C]
    ids, sampler = ids.masked_fill(~mask, pad), sampler.masked_fill(~mask, 0.0)
    texts = family.tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Rollout(completion_ids=ids.to(device), completion_mask=mask.to(device), texts=texts,
                   group_size=group_size, sampler_logps=sampler.to(device))


class VLLMEngineBase(Engine):
    """A vLLM engine: it samples with weights of its own, returns each token's sampler log-prob (the on-policy
    check, and the correction rollout.<section>.tis_cap asks for), and rolls out trajectories with tools.
    A subclass names its settings' `section` and what its mismatch warning tells the user to check."""

    returns_logps = True
    own_weights = True
    multi_turn = True
    section = "rollout.vllm"  # the settings' section, named in the warning
    sampler_label = "the sampler's"  # whose log-probs, in the warning
    mismatch_checks = "the weight sync and dtype"  # what to check, in the warning

    @property
    def correction(self) -> Correction:
        return Correction(sampler_check=True, tis_cap=self.settings.tis_cap)

    def mismatch_warning(self, metrics: dict) -> str | None:
        return logp_mismatch_warning(metrics, self.settings.max_logp_mismatch, sampler=self.sampler_label,
                                     section=self.section, checks=self.mismatch_checks)

    def take_tools(self, settings: MultiTurnSettings, tools: tuple[str, ...]) -> None:
        reason = self.family.multi_turn_unsupported() if settings.multi_turn else None
        if reason is not None:
            raise UserError(f"rollout.max_turns={settings.max_turns} cannot run on this model: {reason}; set "
                            "rollout.max_turns=1.")
        super().take_tools(settings, tools)
