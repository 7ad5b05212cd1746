"""Scoring in a test as a run scores: the path chosen from the trainer's two switches (`choose_scoring_path`), then
the one scoring function (`gpg_vl.models.scoring.token_logps`)."""

from __future__ import annotations

from gpg_vl.models import scoring


def token_logps(family, model, prompts, prompt_index, completion_ids, completion_mask, *, share_vision: bool = True,
                share_prompt: bool = False, **kwargs):
    """Log-probs [N, C] on the path a run with trainer.share_vision / share_prompt would take (the trainer's
    defaults), or on `path=` when given."""
    if "path" not in kwargs:
        kwargs["path"] = scoring.choose_scoring_path(family, model, share_prompt=share_prompt,
                                                     share_vision=share_vision)
    return scoring.token_logps(family, model, prompts, prompt_index, completion_ids, completion_mask, **kwargs)


def path_for(family, model, settings):
    """The scoring path a run with these trainer settings chooses at setup (its share_prompt / share_vision /
    packing)."""
    return scoring.choose_scoring_path(family, model, share_prompt=settings.share_prompt,
                                       share_vision=settings.share_vision, packing=settings.packing)


SCORERS = ("token_logps", "token_logps_and_entropy")  # the update's own forward is the second (it logs entropy)


def on_every_scoring(monkeypatch, record) -> None:
    """Call `record(family, model, prompts, prompt_index, ...)` (the scoring call's arguments) before every scoring
    forward, through either function of `SCORERS`."""
    for name in SCORERS:
        original = getattr(scoring, name)

        def recorded(*args, _original=original, **kwargs):
            record(*args, **kwargs)
            return _original(*args, **kwargs)

        monkeypatch.setattr(scoring, name, recorded)
