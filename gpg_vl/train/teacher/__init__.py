"""The teacher of on-policy distillation (docs/distillation.md): a model loaded beside the student (local.py) or
vLLM servers that serve it (server.py)."""
