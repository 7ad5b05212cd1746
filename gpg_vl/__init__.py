"""gpg-vl: Group Policy Gradient reinforcement learning for vision-language models."""

from gpg_vl.data.task import Task, get_task, image_question, list_tasks, register_task
from gpg_vl.errors import UserError
from gpg_vl.objective import (
                              get_advantage,
                              get_policy_loss,
                              group_advantages,
                              policy_loss,
                              register_advantage,
                              register_policy_loss,
)

__all__ = [
    "Task", "UserError", "get_advantage", "get_policy_loss", "get_task", "group_advantages", "image_question",
    "list_tasks", "policy_loss", "register_advantage", "register_policy_loss", "register_task",
]
__version__ = "0.1.0"
