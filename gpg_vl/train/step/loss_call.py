"""Calling trainer.loss: the loss resolved once per step (`resolve_loss`: the function, its aggregation, what it
needs, its keyword options), the contract checked on what it returns (`checked_loss`), and the token means of its own
metrics over micro-batches, steps and processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.objective import get_policy_loss, loss_aggregation, loss_needs, loss_options

LOSS_REPORTS = ("kl", "clip_fraction_low", "clip_fraction_high", "ratio_mean")  # token means, when a loss has them


LOSS_METRICS = ("num_tokens", "logp_mean")  # what the trainer reads from every loss's metrics


LOSS_CONTRACT = ("it must return (loss, metrics): a 0-d tensor with grad, and a dict of numbers holding at least "
                 f"{', '.join(LOSS_METRICS)} (and with ratio_mean also {', '.join(LOSS_REPORTS[:3])}, ratio_max, "
                 "logp_drift)")


def trainer_loss_options(settings: TrainerSettings, max_new_tokens: int | None) -> dict:
    """The keyword options of trainer.loss: trainer.loss_options, else the trainer settings of that name,
    else max_tokens = the completion limit (objective.loss_options). Fails in one sentence on an option the
    loss does not declare."""
    defaults = {"clip_low": settings.clip_low, "clip_high": settings.clip_high, "kl_coef": settings.kl_coef,
                "max_tokens": max_new_tokens}
    return loss_options(get_policy_loss(settings.loss), dict(settings.loss_options or {}), defaults,
                        name=settings.loss)


@dataclass(frozen=True)
class LossCall:
    """trainer.loss as a step calls it, resolved once (`resolve_loss`): its function, its aggregation (the one it
    fixes, else trainer.aggregation), what it needs ("old", "ref"), its keyword options, and its KL coefficient."""

    name: str
    fn: object
    aggregation: str
    needs: tuple[str, ...]
    options: dict
    kl_coef: float

    @property
    def kl_everywhere(self) -> bool:
        """Whether its KL to the frozen reference is on (it declares "ref" and its kl_coef > 0): it then scores a
        reference, and its KL acts on every sampled sequence, so the update forwards the groups without signal too
        (TRL's and R1-V's GRPO)."""
        return "ref" in self.needs and self.kl_coef > 0


def resolve_loss(settings: TrainerSettings, max_new_tokens: int | None) -> LossCall:
    """trainer.loss resolved (`LossCall`); an option it does not declare fails in one sentence
    (`trainer_loss_options`)."""
    fn = get_policy_loss(settings.loss)
    options = trainer_loss_options(settings, max_new_tokens)
    return LossCall(settings.loss, fn, loss_aggregation(fn, settings.aggregation), loss_needs(fn), options,
                    float(options.get("kl_coef", settings.kl_coef) or 0.0))


def checked_loss(name: str, loss_fn, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    """trainer.loss=`name` called on one micro-batch, its contract checked here (`LOSS_CONTRACT`): a raise, or
    anything else returned, fails in one sentence naming the setting and what came back."""
    try:
        result = loss_fn(*args, **kwargs)
    except (UserError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # a plugin's own failure, told in one sentence
        raise UserError(f"trainer.loss={name} raised {type(error).__name__}: {error}; {LOSS_CONTRACT}.") from error
    if not (isinstance(result, tuple | list) and len(result) == 2):
        what = "a bare tensor" if isinstance(result, torch.Tensor) else f"a {type(result).__name__}"
        raise UserError(f"trainer.loss={name} returned {what}; {LOSS_CONTRACT}.")
    loss, metrics = result
    problem = None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        problem = f"a loss of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"a loss of type {type(loss).__name__}"
    elif not loss.requires_grad:
        problem = "a loss without grad (detached, or computed under no_grad)"
    elif not isinstance(metrics, dict):
        problem = f"metrics of type {type(metrics).__name__}"
    else:
        required = LOSS_METRICS + ((*LOSS_REPORTS, "ratio_max", "logp_drift") if "ratio_mean" in metrics else ())
        missing = [key for key in required if key not in metrics]
        wrong = [key for key in required if key in metrics and not _is_number(metrics[key])]
        if missing:
            problem = f"metrics without {', '.join(missing)}"
        elif wrong:
            problem = f"metrics whose {', '.join(wrong)} is not a number"
    if problem:
        raise UserError(f"trainer.loss={name} returned {problem}; {LOSS_CONTRACT}.")
    return loss, metrics


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not isinstance(value, str | bytes)


def _add_report(report: dict[str, float], info: dict[str, float], *, later: bool) -> None:
    """Add one micro-batch's loss metrics (token-weighted) to this step's sums."""
    if "ratio_mean" not in info:
        return
    tokens = info["num_tokens"]
    report["tokens"] = report.get("tokens", 0.0) + tokens
    for key in LOSS_REPORTS:
        report[key] = report.get(key, 0.0) + info[key] * tokens
    report["ratio_max"] = max(report.get("ratio_max", 0.0), info["ratio_max"])
    if later:
        report["later_tokens"] = report.get("later_tokens", 0.0) + tokens
        report["logp_drift"] = report.get("logp_drift", 0.0) + info["logp_drift"] * tokens


def _loss_reports(reports: list[dict], accelerator: Accelerator) -> dict[str, float]:
    """Token means over every optimizer step and process of the loss's own metrics (`LOSS_REPORTS`), the
    largest ratio, and `logp_drift` (new minus old log-prob) over the steps after the first. Collective."""
    keys = ("tokens", *LOSS_REPORTS, "later_tokens", "logp_drift")
    local = torch.tensor([[sum(r.get(k, 0.0) for r in reports) for k in keys]
                          + [max((r.get("ratio_max", 0.0) for r in reports), default=0.0)]],
                         dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(local)  # [processes, len(keys) + 1]
    totals = dict(zip(keys, gathered[:, :-1].sum(0).tolist(), strict=True))
    result = {k: totals[k] / max(totals["tokens"], 1.0) for k in LOSS_REPORTS}
    result["ratio_max"] = float(gathered[:, -1].max())
    if totals["later_tokens"]:
        result["logp_drift"] = totals["logp_drift"] / totals["later_tokens"]
    return result
