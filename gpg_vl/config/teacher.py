"""`teacher.*`, the section of on-policy distillation (docs/distillation.md), declared as gpg_vl/config/schema.py
declares the others (imported there: `from gpg_vl.config.schema import TeacherSettings` holds)."""

from dataclasses import dataclass, field

from gpg_vl.config.keys import meta


@dataclass
class TeacherSettings:
    """`teacher.*`: on-policy distillation from a frozen teacher on the student's own samples
    (gpg_vl/objective/teacher_losses.py, gpg_vl/train/teacher/, docs/distillation.md); in a mixture a task's own
    teacher is task.teacher.<entry>.* over these."""

    model: str | None = field(default=None, metadata=meta(
        "the teacher: a model folder or hub id with the student's tokenizer and processor (null = no teacher, or "
        "teacher.urls)"))
    coef: float = field(default=1.0, metadata=meta(
        "beta: reverse_kl adds coef * (log teacher - log student) to each token's advantage; jsd adds coef x the "
        "JSD to the loss", above=0))
    tolerance: float = field(default=1e-3, metadata=meta(
        "reverse_kl: a token whose teacher log-prob is within this many nats of the student's gives no teacher signal "
        "(a teacher on vLLM servers differs from the same weights in process by rounding and, asked by "
        "prompt_logprobs, the vision placeholders' share: up to 3.9e-4 measured; 0 = every gap counts)", low=0,
        note="docs/distillation.md#the-tolerance"))
    only: bool = field(default=False, metadata=meta(
        "true = pure distillation: the task reward gives no advantage (it is still scored and logged)"))
    loss: str = field(default="reverse_kl", metadata=meta(
        "reverse_kl: the teacher's log-prob gap as a per-token advantage (policy-gradient form); jsd: GKD's "
        "generalized JSD over the full vocabulary (supervised form)", choices="teacher_losses", references=True))
    beta: float = field(default=0.5, metadata=meta(
        "jsd: the interpolation (0 = KL(teacher || student), 1 = KL(student || teacher), TRL's GKD convention; in "
        "between the generalized JSD, which vanishes as beta nears 0 or 1)",
        low=0, high=1))
    dtype: str = field(default="auto", metadata=meta(
        "the teacher's weights' dtype (auto = model.dtype's rule); frozen, no optimizer state",
        choices=("auto", "float32", "bfloat16", "float16")))
    urls: str | None = field(default=None, metadata=meta(
        "the teacher on vLLM servers instead of teacher.model: http://host:port,... of `vllm serve TEACHER "
        "--enable-scale-out`, asked for the sampled tokens' log-probs (null = teacher.model)"))
    timeout_s: float = field(default=300.0, metadata=meta(
        "teacher.urls: seconds a teacher server may stay unreachable before the run stops", above=0))
    max_concurrency: int = field(default=16, metadata=meta(
        "teacher.urls: scoring requests in flight at once, per trainer process", low=1))

    @property
    def enabled(self) -> bool:
        """A teacher is named: a model loaded beside the student (teacher.model) or vLLM servers (teacher.urls)."""
        return self.model is not None or self.urls is not None
