"""The contracts of user plugins, checked where they are called: an advantage (`trainer.advantage=path.py:fn`,
in step/sample.py) and a policy loss (`trainer.loss=path.py:fn`, in step/loss_call.py) that raise or return the wrong
thing fail in one sentence naming the setting and what came back, at step 1 of a run through the command line."""

from __future__ import annotations

import json
import re

import pytest

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config
from gpg_vl.errors import UserError

FAST = ["task=shapes", "model=tiny", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=2",
        "trainer.group_size=2", "rollout.max_new_tokens=8", "trainer.max_steps=1", "trainer.beta_th=0"]

ADVANTAGES = {
    "raises": ("def fn(rewards):\n    raise ValueError('no baseline today')\n",
               "raised ValueError: no baseline today; it must map rewards [b, G] to (advantages [b, G], valid [b] "
               "bool)."),
    "one_tensor": ("def fn(rewards):\n    return rewards - rewards.mean(dim=1, keepdim=True)\n",
                   "returned one tensor of shape [2, 2] (float32); it must map rewards"),
    "flat": ("def fn(rewards):\n    return rewards.flatten(), rewards[:, 0] > 0\n",
             "returned advantages of shape [4] (float32) for rewards of shape [2, 2]; it must map"),
    "valid_floats": ("def fn(rewards):\n    return rewards * 0, rewards[:, 0] * 0 + 1\n",
                     "returned valid of shape [2] (float32) for 2 groups; it must map"),
}

LOSS_HEAD = ("import torch\nfrom gpg_vl.objective import policy_loss\n"
             "def signal(rewards):  # every group valid, so that the loss is called at step 1\n"
             "    return torch.ones_like(rewards), torch.ones(rewards.shape[0], dtype=torch.bool)\n")
LOSSES = {
    "raises": (LOSS_HEAD + "def fn(logps, mask, adv, **kw):\n    raise ValueError('bad shapes')\n",
               "raised ValueError: bad shapes; it must return (loss, metrics): a 0-d tensor with grad, and a dict of "
               "numbers holding at least num_tokens, logp_mean"),
    "bare_tensor": (LOSS_HEAD + "def fn(logps, mask, adv, **kw):\n    return policy_loss(logps, mask, adv, **kw)[0]\n",
                    "returned a bare tensor; it must return (loss, metrics)"),
    "no_logp_mean": (LOSS_HEAD + "def fn(logps, mask, adv, **kw):\n    loss, m = policy_loss(logps, mask, adv, **kw)\n"
                     "    del m['logp_mean']\n    return loss, m\n",
                     "returned metrics without logp_mean; it must return (loss, metrics)"),
    "per_token": (LOSS_HEAD + "def fn(logps, mask, adv, **kw):\n    loss, m = policy_loss(logps, mask, adv, **kw)\n"
                  "    return -logps * adv[:, None], m\n",
                  "returned a loss of shape ["),
    "detached": (LOSS_HEAD + "def fn(logps, mask, adv, **kw):\n    loss, m = policy_loss(logps, mask, adv, **kw)\n"
                 "    return loss.detach(), m\n",
                 "returned a loss without grad (detached, or computed under no_grad)"),
}


def _run(tmp_path, key: str, source: str, *extra: str) -> str:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(source)
    with pytest.raises(UserError) as info:
        train_main(load_config("train", [*FAST, f"{key}={plugin}:fn", f"output_dir={tmp_path / 'run'}", *extra]))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={plugin}:fn ")
    return message


@pytest.mark.parametrize("case", sorted(ADVANTAGES))
def test_an_advantage_plugin_that_breaks_its_contract_fails_in_one_sentence(tmp_path, case):
    source, expected = ADVANTAGES[case]
    assert expected in _run(tmp_path, "trainer.advantage", source)


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_a_loss_plugin_that_breaks_its_contract_fails_in_one_sentence(tmp_path, case):
    source, expected = LOSSES[case]
    message = _run(tmp_path, "trainer.loss", source, f"trainer.advantage={tmp_path / 'plugin.py'}:signal")
    assert re.search(re.escape(expected), message), message


def test_a_loss_plugin_that_keeps_its_contract_trains(tmp_path):
    plugin = tmp_path / "half.py"
    plugin.write_text(LOSS_HEAD + "def fn(logps, mask, adv, *, scale: float = 0.5, **kw):\n"
                      "    loss, m = policy_loss(logps, mask, adv, **kw)\n    return loss * scale, m\n")
    train_main(load_config("train", [*FAST, f"trainer.loss={plugin}:fn", "trainer.loss_options.scale=0.25",
                                     f"trainer.advantage={plugin}:signal",
                                     f"output_dir={tmp_path / 'run'}"]))
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert metrics["optimizer_steps"] == 1.0 and metrics["groups_used"] == 2


TASK_HEAD = "from gpg_vl_tasks.shapes import Shapes\n"
TASKS = {  # a task from outside whose own code raises: where, and what the sentence says
    "at_import": (TASK_HEAD + "raise RuntimeError('broken at import')\nclass T(Shapes):\n    name = 'broken'\n",
                  "task.name={plugin}:T: loading {plugin} raised RuntimeError: broken at import; fix that code."),
    "in_init": (TASK_HEAD + "class T(Shapes):\n    name = 'broken'\n    def __init__(self, **options):\n"
                "        raise ValueError('broken in __init__')\n",
                "task {plugin}:T could not be built: T(...) raised ValueError: broken in __init__; fix its __init__ "
                "or its options (task.options.*)."),
    "in_load": (TASK_HEAD + "class T(Shapes):\n    name = 'broken'\n    def load(self, split):\n"
                "        raise KeyError('broken in load')\n",
                "task broken could not load its 'train' split: T.load raised KeyError: 'broken in load'; fix its "
                "load() or its data (data.path)."),
}


@pytest.mark.parametrize("case", sorted(TASKS))
def test_a_task_plugin_whose_code_raises_fails_in_one_sentence(tmp_path, case, request):
    """A `file.py:Class` task raising at import, in __init__ or in load() ended in a raw traceback (issue 59); the
    first two before the model loads (load() runs as the run is set up, after it)."""
    from gpg_vl.data.mixture import build_mixture

    if case != "in_load":
        request.getfixturevalue("no_model")
    plugin = tmp_path / "plugin.py"
    source, expected = TASKS[case]
    plugin.write_text(source)
    with pytest.raises(UserError) as info:
        train_main(load_config("train", [*FAST[1:], f"task={plugin}:T", f"output_dir={tmp_path / 'run'}"]))
    assert str(info.value) == expected.format(plugin=plugin)
    if case != "in_load":  # in a mixture: the entry named first
        with pytest.raises(UserError) as info:
            build_mixture({f"{plugin}:T": 1, "shapes": 1}, {}, {})
        assert str(info.value) == f"task.mixture.{plugin}:T: " + expected.format(plugin=plugin)
