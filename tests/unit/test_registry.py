"""The one Registry behind every kind of plugin: duplicates and unknown names fail in one sentence, every kind
loads `module:name` and `path.py:name`, and built-ins are imported only when first asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.data.task import TASKS, Task, get_task, register_task
from gpg_vl.errors import UserError
from gpg_vl.models.family import FAMILIES, get_family, register_family
from gpg_vl.models.generic import GenericFamily
from gpg_vl.objective import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from gpg_vl.registry import Registry
from gpg_vl.rollout.engine import ENGINES, Engine, register_engine, require_engine
from gpg_vl.rollout.hf import HFEngine

ROOT = Path(__file__).resolve().parents[2]


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.endswith(".") and message.count(". ") == 0


# ---------------------------------------------------------------------------------------------
# the class itself
# ---------------------------------------------------------------------------------------------
def test_register_get_names_and_membership():
    registry = Registry("widget", "widget.kind")

    @registry.register("round")
    def round_widget():
        return "round"

    @registry.register
    def square():
        return "square"

    assert registry.get("round") is round_widget and registry["square"] is square
    assert registry.names() == ["round", "square"] and "round" in registry and "oval" not in registry
    registry.register("round")(round_widget)  # the same object again is not a duplicate
    registry.unregister("square")
    assert registry.names() == ["round"]


def test_a_duplicate_name_fails_in_one_sentence_naming_the_kind_the_name_and_the_first():
    registry = Registry("widget", "widget.kind")
    registry.register("round")(lambda: 1)
    with pytest.raises(UserError) as error:
        registry.register("round")(lambda: 2)
    message = str(error.value)
    assert one_sentence(message) and message.startswith("the widget 'round' is already registered (by ")
    assert "test_registry" in message  # where the first came from


def test_a_builtin_name_is_taken_before_its_module_is_imported():
    registry = Registry("widget", "widget.kind", builtins={"pi": "math:pi"})
    with pytest.raises(UserError, match=r"the widget 'pi' is already registered \(by math:pi\)"):
        registry.register("pi")(lambda: 3)
    assert registry.get("pi") == pytest.approx(3.14159, abs=1e-5)


def test_an_unknown_name_lists_the_valid_ones_and_the_outside_forms_in_one_sentence():
    registry = Registry("widget", "widget.kind", builtins={"pi": "math:pi"})
    registry.register("round")(lambda: 1)
    with pytest.raises(UserError) as error:
        registry.get("oval")
    message = str(error.value)
    assert message.startswith("unknown widget.kind 'oval'; valid options: pi, round (or load a widget from outside")
    assert "widget.kind=module:name" in message and "widget.kind=path.py:name" in message and "\n" not in message


@pytest.mark.parametrize(("duplicate", "kind"), [
    (lambda: register_policy_loss("gpg")(lambda *a, **k: None), "policy loss 'gpg'"),
    (lambda: register_advantage("none")(lambda r: r), "advantage estimator 'none'"),
    (lambda: register_task(type("Shapes2", (Task,), {"name": "shapes"})), "task 'shapes'"),
    (lambda: register_family(type("Generic2", (GenericFamily,), {"name": "generic"})), "model family 'generic'"),
    (lambda: register_engine(type("HF2", (HFEngine,), {"name": "hf"})), "rollout engine 'hf'"),
])
def test_every_kind_refuses_a_duplicate(duplicate, kind):
    with pytest.raises(UserError, match=f"the {kind} is already registered") as error:
        duplicate()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("lookup", "key", "names"), [
    (get_policy_loss, "trainer.loss", "bnpo, cispo, dapo, dr_grpo, gmpo, gpg, grpo, gspo, luspo, sapo, vespo"),  # noqa: E501
    (get_advantage, "trainer.advantage", "group_mean, none, std_normalized"),
    (get_task, "task.name", "classification, .*shapes.*"),  # other tests may have registered more after shapes
    (get_family, "model.family", "generic, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_vl"),
    (ENGINES.get, "rollout.engine", "hf, vllm, vllm_server"),
])
def test_every_kind_lists_its_valid_names_for_an_unknown_one(lookup, key, names):
    pattern = f"unknown {key} 'nope'; valid options: {names} \\(or load .* {key}=path.py:name"
    with pytest.raises(UserError, match=pattern):
        lookup("nope")


# ---------------------------------------------------------------------------------------------
# module:name and path.py:name, for each kind
# ---------------------------------------------------------------------------------------------
PLUGIN = textwrap.dedent('''
    import torch
    from gpg_vl.data.task import Task
    from gpg_vl.models.generic import GenericFamily
    from gpg_vl.rollout.hf import HFEngine

    def my_loss(token_logps, completion_mask, advantages, **kwargs):
        return token_logps.sum() * 0, {}

    def my_advantage(rewards):
        return rewards - rewards.mean(dim=1, keepdim=True), torch.ones(rewards.shape[0], dtype=torch.bool)

    class MyTask(Task):
        name = "PREFIX_task"

        def load(self, split):
            return [{"id": "0", "answer": "x"}]

    class MyFamily(GenericFamily):
        name = "PREFIX_family"

    class MyEngine(HFEngine):
        name = "PREFIX_engine"
''')


@pytest.fixture(params=["module", "file"])
def reference(request, tmp_path, monkeypatch):
    """`reference(name)` -> `module:name` or `path.py:name` of a plugin file defining one plugin of each kind."""
    prefix = f"plugin_{request.param}_{abs(hash(str(tmp_path))) % 10**8}"
    path = tmp_path / f"{prefix}.py"
    path.write_text(PLUGIN.replace("PREFIX", prefix))
    if request.param == "module":
        monkeypatch.syspath_prepend(str(tmp_path))
        return lambda name: f"{prefix}:{name}"
    return lambda name: f"{path}:{name}"


def test_a_loss_and_an_advantage_load_from_outside(reference):
    loss = get_policy_loss(reference("my_loss"))
    assert loss.__name__ == "my_loss" and "my_loss" not in POLICY_LOSSES
    adv, valid = get_advantage(reference("my_advantage"))(torch.tensor([[1.0, 3.0]]))
    assert adv.tolist() == [[-1.0, 1.0]] and valid.tolist() == [True] and "my_advantage" not in ADVANTAGE_ESTIMATORS


def test_a_task_loads_from_outside_and_is_registered_under_its_name(reference):
    task = get_task(reference("MyTask"))
    assert type(task).__name__ == "MyTask" and task.name in TASKS
    assert get_task(task.name).load("train") == [{"id": "0", "answer": "x"}]
    TASKS.unregister(task.name)


def test_a_family_loads_from_outside(reference):
    family = get_family(reference("MyFamily"))
    assert issubclass(family, GenericFamily) and family.__name__ == "MyFamily"
    with pytest.raises(UserError, match=r"model.family=.*:my_loss is not a Family subclass; name a Family subclass"):
        get_family(reference("my_loss"))


def test_an_engine_loads_from_outside(reference):
    settings = RolloutSettings(engine=reference("MyEngine"))
    engine = require_engine(settings)
    assert issubclass(engine, HFEngine) and engine.__name__ == "MyEngine"
    with pytest.raises(UserError, match=r"rollout.engine=.*:MyTask is not an Engine subclass"):
        ENGINES.get(reference("MyTask"))


def test_the_settings_accept_a_family_and_an_engine_from_outside(reference):
    from gpg_vl.config.validate import rules

    table = rules()  # the checks derived from the schema (gpg_vl/config/schema.py)
    assert table["model.family"].allows(reference("MyFamily")) and table["rollout.engine"].allows(reference("E"))
    assert not table["model.family"].allows("nope") and "path.py:name" in table["rollout.engine"].allowed()


def test_a_missing_file_or_module_fails_in_one_sentence(tmp_path):
    with pytest.raises(UserError, match=r"file .* does not exist; give rollout.engine=path/to/file.py:name\."):
        ENGINES.get(f"{tmp_path}/absent.py:MyEngine")
    with pytest.raises(UserError, match=r"cannot import module 'no_such_module_x' .*; check model.family\."):
        get_family("no_such_module_x:MyFamily")


# ---------------------------------------------------------------------------------------------
# built-ins: found lazily, without import side effects
# ---------------------------------------------------------------------------------------------
def test_builtins_are_imported_on_first_use_only():
    code = textwrap.dedent('''
        import sys
        import gpg_vl.rollout.engine as engine
        import gpg_vl.models.family as family
        assert "gpg_vl.rollout.vllm.colocated" not in sys.modules and "gpg_vl.rollout.hf" not in sys.modules
        assert "gpg_vl.models.qwen" not in sys.modules and "gpg_vl.models.generic" not in sys.modules
        assert engine.ENGINES.names() == ["hf", "vllm", "vllm_server"] and "vllm" in engine.ENGINES
        assert "gpg_vl.rollout.vllm.colocated" not in sys.modules and "gpg_vl.models.qwen" not in sys.modules
        assert engine.ENGINES.get("hf").__name__ == "HFEngine" and "gpg_vl.rollout.vllm.colocated" not in sys.modules
        assert family.FAMILIES.get("generic").__name__ == "GenericFamily" and "gpg_vl.models.qwen" not in sys.modules
        assert family.family_for("qwen3_vl_moe") == "qwen3_vl"
        print("ok")
    ''')
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_registered_builtins_are_the_classes_their_references_name():
    for registry in (FAMILIES, ENGINES):
        for name, reference in registry.builtins.items():
            plugin = registry.get(name)
            assert f"{plugin.__module__}:{plugin.__qualname__}" == reference and plugin.name == name
    assert issubclass(ENGINES.get("vllm"), Engine)
