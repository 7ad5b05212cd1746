"""The command line: config composition and the one-sentence errors a user meets."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from gpg_vl.config import load_config, run_cli
from gpg_vl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_embedded_job():
    cfg = load_config("train", [])
    assert cfg.task.name == "shapes" and cfg.model.name_or_path == "embedded:tiny-qwen2.5-vl"


@pytest.mark.parametrize("key", ["output_dir=/tmp/x", "seed=3", "trainer.max_steps=2", "trainer.group_size=4",
                                 "trainer.batch_size=2", "trainer.micro_batch_size=4", "trainer.lr=0.00001",
                                 "trainer.beta_th=0.6", "trainer.max_attempts=3", "trainer.save_every=1",
                                 "rollout.max_new_tokens=8", "rollout.temperature=0.7", "rollout.ignore_eos=true",
                                 "model.name_or_path=/some/local/dir"])
def test_contract_keys_are_accepted(key):
    name, value = key.split("=")
    assert OmegaConf.select(load_config("train", [key]), name) == yaml.safe_load(value)


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(UserError) as error:
        load_config("train", ["trainer.lrr=1"])
    message = str(error.value)
    assert "trainer.lrr" in message and "trainer.lr" in message and "trainer.beta_th" in message


def test_unknown_model_and_task_list_the_known_ones():
    with pytest.raises(UserError, match="qwen2.5-vl-7b"):
        load_config("train", ["model=qwen9"])
    with pytest.raises(UserError, match="shapes"):
        load_config("train", ["task=nope"])


def test_model_aliases_point_at_instruct_hub_ids():
    assert load_config("train", ["model=qwen2.5-vl-7b"]).model.name_or_path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert load_config("train", ["model=qwen2.5-vl-3b"]).model.name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"


def test_unreachable_hub_model_fails_in_one_sentence(tmp_path, capsys):
    def boom(cfg):
        from gpg_vl.cli import build_policy

        build_policy(cfg.model, "cpu")

    code = run_cli("train", boom, ["model=qwen2.5-vl-3b", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "Qwen/Qwen2.5-VL-3B-Instruct" in err and "model.name_or_path=" in err


def test_script_prints_resolved_config_and_reports_errors_without_traceback():
    ok = subprocess.run([sys.executable, "scripts/train.py", "trainer.max_steps=7", "--cfg", "job"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "max_steps: 7" in ok.stdout
    bad = subprocess.run([sys.executable, "scripts/train.py", "rollout.max_new_token=3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "rollout.max_new_tokens" in bad.stderr


def test_model_can_be_a_local_directory_whose_family_is_read_from_its_config(tmp_path):
    from gpg_vl.models.base import _family_of

    cfg = load_config("train", [f"model={ROOT / 'gpg_vl' / 'assets' / 'tiny-qwen2.5-vl'}"])
    assert cfg.model.family == "auto" and cfg.model.name_or_path.endswith("tiny-qwen2.5-vl")
    assert _family_of(cfg.model.name_or_path) == "qwen2_5_vl"
    with pytest.raises(UserError, match="model.family="):
        _family_of(str(tmp_path))
