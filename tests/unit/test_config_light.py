"""The config is read, typed and checked before torch, transformers, accelerate or datasets are imported (issue
28): a bad key or value costs the command line well under a second (scripts/config_latency.py measures it; the
table is in docs/robustness.md). Asserted structurally here, in fresh interpreters, not by timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpg_vl.config import names

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import json, sys
from gpg_vl.cli import eval_main, train_main  # what scripts/train.py and scripts/eval.py import
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.errors import UserError

HEAVY = ("torch", "transformers", "accelerate", "datasets")
name, overrides = sys.argv[1], json.loads(sys.argv[2])
try:
    load_config(name, overrides)
    outcome = "accepted"
except UserError as error:
    outcome = "UserError: " + str(error)
code = run_cli(name, train_main if name == "train" else eval_main, [*overrides, "--cfg", "job"])
print(json.dumps({"outcome": outcome, "code": code, "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


def check_in_a_fresh_process(name: str, overrides: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK, name, json.dumps(overrides)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, overrides, says", [
    ("train", ["trainer.lr=abc"], "trainer.lr=abc has the wrong type"),
    ("train", ["trainer.lrr=1"], "unknown config key 'trainer.lrr'"),
    ("train", ["trainer.lr_schedule=bogus"], "one of linear, cosine"),
    ("train", ["trainer.loss=bogus"], "one of bnpo, cispo, dapo, dr_grpo, gmpo, gpg, grpo, gspo, luspo, sapo, vespo"),
    ("train", ["trainer.advantage=bogus"], "one of group_mean, none, std_normalized"),
    ("train", ["trainer.report_to=bogus"], "one of none, all"),
    ("train", ["rollout.engine=bogus"], "one of hf, vllm"),
    ("train", ["model.family=bogus"], "one of auto, generic"),
    ("train", ["trainer.group_size=1"], "trainer.group_size=1"),
    ("train", ["trainer.kl_coef=0.1"], "needs a loss with a KL term"),
    ("train", ["trainer.loss=dapo"], "set trainer.aggregation=token_mean"),
    ("train", ["algorithm=dapo", "trainer.overlong_cache=100", "rollout.max_new_tokens=12"],
     "trainer.overlong_cache=100 above rollout.max_new_tokens=12"),
    ("eval", ["segmenter=mask"], "one of box, sam, sam2"),
    ("eval", ["rollout.hf.decode=fast"], "one of loop, generate"),
])
def test_a_bad_value_is_refused_before_any_heavy_library_is_imported(name, overrides, says):
    found = check_in_a_fresh_process(name, overrides)
    assert found["outcome"].startswith("UserError: ") and says in found["outcome"], found
    assert found["code"] == 2 and found["heavy"] == [], found


def test_a_good_config_is_composed_and_typed_without_them():
    for name, overrides in (("train", []), ("train", ["algorithm=grpo"]), ("eval", [])):
        found = check_in_a_fresh_process(name, overrides)
        assert found == {"outcome": "accepted", "code": 0, "heavy": []}, (name, found)


# ---------------------------------------------------------------------------------------------
# the light lists agree with their sources
# ---------------------------------------------------------------------------------------------
def builtin_names(registry, module: str) -> set[str]:
    return set(registry.builtins) | {name for name, origin in registry._origins.items()
                                     if origin.startswith(module + ":")}


def test_the_built_in_names_are_the_registries_built_ins():
    import importlib

    for key, (module, attribute, builtins) in names.REGISTRIES.items():
        registry = getattr(importlib.import_module(module), attribute)
        assert builtin_names(registry, module) == set(builtins), key
        assert set(builtins) <= set(names.registered(key)), key


def test_the_built_in_losses_declare_what_the_table_says():
    from gpg_vl.config.schema import loss_declaration
    from gpg_vl.objective import AGGREGATIONS, BASELINES, get_policy_loss, loss_needs

    for name, (needs, aggregation) in names.LOSSES.items():
        loss = get_policy_loss(name)
        assert (loss_needs(loss), getattr(loss, "aggregation", None)) == (needs, aggregation), name
        assert loss_declaration(name) == (needs, aggregation), name
    assert set(names.LOSSES) == set(names.REGISTRIES["losses"][2])
    assert tuple(sorted(AGGREGATIONS)) == names.AGGREGATIONS and tuple(BASELINES) == names.BASELINES


def test_the_library_lists_are_the_installed_libraries():
    from accelerate.utils import LoggerType
    from transformers import SchedulerType

    from gpg_vl.models.family import BOX_FRAMES
    from gpg_vl.reward.segment import SEGMENTERS
    from gpg_vl.rollout.hf import DECODERS

    assert names.SCHEDULES == tuple(s.value for s in SchedulerType)
    assert names.TRACKERS == tuple(t.value for t in LoggerType)
    assert names.DECODERS == tuple(DECODERS) and names.BOX_FRAMES == tuple(BOX_FRAMES)
    assert names.SEGMENTERS == tuple(SEGMENTERS)
