"""The frozen reference of a loss with a KL term: built from the initial weights (or, with LoRA, the policy with its
adapters disabled), placed like the policy (FSDP2 shards, a ZeRO-3 engine)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.train.step.loss_call import resolve_loss


@dataclass
class Reference:
    """The frozen reference model (the initial weights) for a loss with a KL term: a copy of them, or with
    LoRA (`model` None) the policy itself with its adapters disabled (PEFT's `disable_adapter()`)."""

    model: torch.nn.Module | None

    def scoring(self, policy_model):
        """(the model to score, the context to score it in)."""
        if self.model is not None:
            return self.model, contextlib.nullcontext()
        return policy_model, getattr(policy_model, "module", policy_model).disable_adapter()  # under DDP's wrapper


def kl_on_every_group(settings: TrainerSettings) -> bool:
    """Whether trainer.loss's KL to the reference is on (it declares "ref" and its kl_coef > 0): its KL term then
    acts on every sampled sequence, and the update forwards the groups without signal too (TRL, R1-V)."""
    return resolve_loss(settings, None).kl_everywhere


def needs_reference(trainer: TrainerSettings) -> bool:
    """Whether trainer.loss scores a frozen reference model (it declares "ref" and its kl_coef > 0:
    trainer.loss_options.kl_coef, else trainer.kl_coef)."""
    return resolve_loss(trainer, None).kl_everywhere


def build_reference(model: torch.nn.Module, trainer: TrainerSettings, reference: torch.nn.Module | None, *,
                    resuming: bool) -> Reference | None:
    """The frozen reference of `setup` (None when the loss needs none)."""
    if not needs_reference(trainer):
        return None
    if hasattr(model, "disable_adapter"):  # a PEFT model: the base weights are the initial ones
        return Reference(None)
    if reference is None:
        if resuming:
            raise UserError(f"trainer.loss={trainer.loss} with trainer.kl_coef={trainer.kl_coef} scores a reference "
                            "model, the initial weights, which a checkpoint does not hold: pass reference= (the "
                            "command line rebuilds it from model.name_or_path).")
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # a copy's shards belong to no engine
            raise UserError(f"trainer.loss={trainer.loss} with trainer.kl_coef={trainer.kl_coef} scores a reference "
                            "model, and a model loaded partitioned by DeepSpeed ZeRO-3 cannot be copied into one: "
                            "pass reference= (a second load of the initial weights, as the command line does).")
        reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    return Reference(reference)


def place_reference(frozen: Reference | None, accelerator: Accelerator) -> Reference | None:
    """Place a frozen reference copy like the policy: on each process's device (one copy each, as the
    policy's weights under DDP), sharded across the processes under FSDP2 the way accelerate shards the
    policy (its forwards are then collective: `_score_plan` keeps them in step). With LoRA (no copy) the
    reference is the policy itself."""
    if frozen is None or frozen.model is None:
        return frozen
    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return Reference(fsdp2_prepare_model(accelerator, frozen.model.to(accelerator.device)))
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:  # loaded partitioned (zero.Init): only an engine gathers it
        import deepspeed  # no optimizer; its forwards are collective like the policy's (as TRL's prepare_deepspeed)

        config = {k: v for k, v in plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
        engine = deepspeed.initialize(model=frozen.model, config=config)[0]
        engine.eval()  # DeepSpeedEngine.eval() returns None
        return Reference(engine)
    frozen.model.to(accelerator.device)
    return frozen
