"""gpg-vl: Group Policy Gradient reinforcement learning for vision-language models.

The names below are imported on first use (PEP 562), so that `import gpg_vl.config.schema` (the settings, read
by scripts/gen_config_docs.py) does not load torch.
"""

from gpg_vl.errors import UserError

_LAZY = {
    "Task": "gpg_vl.data.task", "get_task": "gpg_vl.data.task", "image_question": "gpg_vl.data.task",
    "list_tasks": "gpg_vl.data.task", "register_task": "gpg_vl.data.task",
    "get_advantage": "gpg_vl.objective", "get_policy_loss": "gpg_vl.objective",
    "group_advantages": "gpg_vl.objective", "policy_loss": "gpg_vl.objective",
    "register_advantage": "gpg_vl.objective", "register_policy_loss": "gpg_vl.objective",
}

__all__ = [
    "Task", "UserError", "get_advantage", "get_policy_loss", "get_task", "group_advantages", "image_question",
    "list_tasks", "policy_loss", "register_advantage", "register_policy_loss", "register_task",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    import importlib.util

    if importlib.util.find_spec(f"gpg_vl.{name}") is not None:  # `gpg_vl.objective` after a bare `import gpg_vl`
        import importlib

        return importlib.import_module(f"gpg_vl.{name}")
    raise AttributeError(f"module 'gpg_vl' has no attribute {name!r}")
