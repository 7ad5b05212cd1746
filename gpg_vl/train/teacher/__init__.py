"""The teacher of on-policy distillation (docs/distillation.md): one door, `build_teacher` and each task's teacher
(build.py), to a model loaded beside the student (local.py) or vLLM servers that serve it (server.py); what the
teacher gives the update (signal.py). The maths is gpg_vl/objective/teacher_losses.py's."""
