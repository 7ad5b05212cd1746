"""The teacher loaded beside the student (`teacher.model`, docs/distillation.md): frozen, it scores the student's
own samples through the update's one scoring path (each prompt once per group, images and video included, a
multi-turn trajectory's observations in its forward, its generated tokens only counted): the sampled tokens'
log-probs (`Teacher.logps`), or its whole distribution at each counted position (`Teacher.logits`), as its loss
reads it (gpg_vl/train/teacher/signal.py). Built through gpg_vl/train/teacher/build.py's `build_teacher`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpg_vl.config.schema import TeacherSettings
from gpg_vl.errors import UserError
from gpg_vl.models import scoring
from gpg_vl.models.batch import unwrap
from gpg_vl.models.logits import output_logits
from gpg_vl.models.scoring import ScoringPath


@dataclass
class Teacher:
    """The frozen teacher model (no gradient, no optimizer state), its scoring path, and its `teacher.*`."""

    model: torch.nn.Module
    path: ScoringPath
    settings: TeacherSettings

    def logps(self, family, chunk, device, *, temperature: float, logits_chunk_tokens: int, messages=None,
              cache=None) -> torch.Tensor:
        """The teacher's log-probs [n, C] of a micro-batch's completions (no gradient). `messages`, `cache`: what the
        teacher on vLLM servers reads (gpg_vl/train/teacher/server.py); the model here has the prompts' pixels."""
        del messages, cache
        with torch.no_grad():
            return chunk.logps(_Frozen(family), self.model, device, path=self.path, temperature=temperature,
                               logits_chunk_tokens=logits_chunk_tokens)

    def bind(self, policy) -> Teacher:
        """Nothing to learn from the student's policy (the teacher on vLLM servers reads its family here)."""
        del policy
        return self

    def logits(self, family, chunk, device, *, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's full-vocabulary logits [T, V'] at the micro-batch's counted positions, and the sampled
        tokens' columns [T] (no gradient)."""
        with torch.no_grad():
            return chunk_logits(family, self.model, chunk, device, path=self.path, temperature=temperature)


@dataclass
class _Frozen:
    """What MicroBatch.logps reads of a policy (its family), for a model that is not the policy."""

    family: object


def chunk_logits(family, model, chunk, device, *, path: ScoringPath,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-vocabulary logits [T, V'] (float32, divided by `temperature`, softcapped as sampled) of `model` at the
    T counted positions of micro-batch `chunk`, row-major, the suppressed ids left out (V' = V minus them); the
    sampled tokens' columns [T] in them): what a loss over the whole distribution (GKD's JSD) reads. One forward
    on `path` (gpg_vl/models/scoring.py's `completion_states`), with gradient where it is enabled."""
    counted, ids, bare = chunk.counted.to(device), chunk.completion_ids.to(device), unwrap(model)
    hidden, logits = scoring.completion_states(family, model, chunk.prompts.to(device), chunk.prompt_index, ids,
                                               counted, path=path, observations=chunk.trajectories, bare=bare)
    if hidden is not None:
        logits = output_logits(hidden[counted], bare.get_output_embeddings().weight, None, temperature,
                               family.logit_softcap(bare))  # [T, V]
    else:
        logits = logits[counted] / temperature  # [T, V]
    targets = ids[counted]  # [T]
    if family.suppressed_ids:
        kept = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[torch.tensor(family.suppressed_ids, device=logits.device)] = False
        logits, targets = logits[:, kept], (kept.long().cumsum(0) - 1)[targets]  # a sampled id is never suppressed
    return logits, targets


def check_tokenizer(teacher: TeacherSettings, student_name: str) -> None:
    """Refuse, in one sentence and before any model loads, a teacher whose tokenizer differs from the student's
    (its log-probs would score other tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    from gpg_vl.models.load import resolve_path

    paths = {"model.name_or_path": resolve_path(str(student_name)), "teacher.model": resolve_path(str(teacher.model))}
    _refuse_adapter(teacher.model, paths["teacher.model"])
    vocabularies, sizes = {}, {}
    for key, path in paths.items():
        try:
            vocabularies[key] = AutoTokenizer.from_pretrained(path).get_vocab()
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise UserError(f"{key}={path} has no tokenizer or config that loads ({type(error).__name__}); "
                            "name a model folder or hub id.") from None
        text = getattr(config, "text_config", None) or config
        sizes[key] = getattr(text, "vocab_size", None)
    if vocabularies["teacher.model"] != vocabularies["model.name_or_path"] or \
            sizes["teacher.model"] != sizes["model.name_or_path"]:
        raise UserError(f"teacher.model={teacher.model} has another tokenizer or vocabulary than the student "
                        f"({student_name}); on-policy distillation scores the student's tokens, so pick a teacher "
                        "of the same tokenizer (the same model family).")


def _refuse_adapter(given: str, path) -> None:
    """A folder holding a LoRA adapter and no model of its own (model.lora.save=adapter): one sentence naming it."""
    from pathlib import Path

    from gpg_vl.models.lora import adapter_base, adapter_folder

    folder = adapter_folder(path) if Path(str(path)).is_dir() else None
    if folder is not None and not (Path(str(path)) / "config.json").is_file():
        raise UserError(f"teacher.model={given} holds a LoRA adapter without its base model's weights "
                        f"(adapter_config.json, base {adapter_base(folder)}); a teacher is loaded whole: name a folder "
                        "saved with model.lora.save=merged (or the adapter merged into its base).")


def frozen_teacher(model: torch.nn.Module, family, teacher: TeacherSettings, trainer) -> Teacher:
    """`model` frozen as the teacher (every parameter, eval mode), with the student's scoring path settings (prompt
    once per group where the model allows)."""
    model.requires_grad_(False)
    model.eval()
    path = scoring.choose_scoring_path(family, model, share_prompt=trainer.share_prompt,
                                       share_vision=trainer.share_vision, packing=trainer.packing)
    return Teacher(model, path, teacher)
