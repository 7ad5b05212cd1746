"""Each key is declared once, in the schema (gpg_vl/config/schema.py): its type, default, range or choices and
meaning; the value checks (gpg_vl/config/validate.py) are derived from it, not restated."""

import subprocess
import sys
from dataclasses import asdict

from gpg_vl.config.keys import declared, key_of
from gpg_vl.config.rules import value_type
from gpg_vl.config.schema import EvalSchema, ModelSettings, TrainSchema
from gpg_vl.config.validate import rules


def test_every_checkable_key_gets_its_check_from_the_schema():
    table = rules()
    for schema in (TrainSchema, EvalSchema):
        for name, item in declared(schema):
            key, (hint, optional) = key_of(item), value_type(item)
            if hint in (bool, int, float) or (key is not None and (key.choices or key.nonempty)):
                assert name in table and table[name].optional == optional, name
    assert table["trainer.lr"].allowed() == "a number > 0"
    assert table["trainer.group_size"].allowed() == "an integer >= 1 (at least 2 with a group baseline)"
    assert table["trainer.beta_th"].allowed() == "a number >= 0 and <= 1"
    assert table["model.dtype"].allowed() == "one of auto, float32, bfloat16, float16"
    assert table["eval.split"].allows(None) and not table["eval.split"].allows(" ")


def test_registry_choices_are_read_lazily_and_plugins_by_reference_pass():
    loss, engine = rules()["trainer.loss"], rules()["rollout.engine"]
    assert {"gpg", "grpo", "dr_grpo", "dapo"} <= set(loss.options()) and loss.allows("my_loss.py:loss")
    assert not loss.allows("ppo") and "module:name" in loss.allowed()
    assert {"hf", "vllm"} <= set(engine.options()) and not engine.allows("sglang")
    assert rules()["model.family"].options()[0] == "auto" and "qwen2_5_vl" in rules()["model.family"].options()


def test_the_model_defaults_have_one_home_and_aliases_only_differ():
    from gpg_vl.config.compose import load_config

    for alias, name, family in (("qwen2.5-vl-3b", "Qwen/Qwen2.5-VL-3B-Instruct", "qwen2_5_vl"),
                                ("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl")):
        composed = load_config("train", [f"model={alias}"]).model
        assert dict(composed) == asdict(ModelSettings(name_or_path=name, family=family)) | {"lora": composed.lora}
        assert dict(composed.lora) == asdict(ModelSettings().lora)


def test_the_schema_imports_without_torch():
    code = ("import sys, gpg_vl.config.schema, gpg_vl.config.validate; "
            "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
