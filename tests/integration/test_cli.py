"""The command line: config composition and the one-sentence errors a user meets."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


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
    from gpg_vl.models.load import _family_of

    cfg = load_config("train", [f"model={ROOT / 'gpg_vl' / 'assets' / 'tiny-qwen2.5-vl'}"])
    assert cfg.model.family == "auto" and cfg.model.name_or_path.endswith("tiny-qwen2.5-vl")
    assert _family_of(cfg.model.name_or_path) == "qwen2_5_vl"
    with pytest.raises(UserError, match="model.family="):
        _family_of(str(tmp_path))


@pytest.mark.parametrize(("override", "words"), [
    ("trainer.lr=abc", ["trainer.lr=abc", "wrong type", "a number"]),
    ("trainer.group_size=2.5", ["trainer.group_size=2.5", "a whole number"]),
    ("rollout.ignore_eos=maybe", ["rollout.ignore_eos=maybe", "true or false"]),
    ("trainer.group_size=0", ["trainer.group_size=0", "allowed", "an integer >= 1"]),
    ("trainer.beta_th=2", ["trainer.beta_th=2", ">= 0 and <= 1"]),
    ("reward.judge.kind=bogus", ["reward.judge.kind='bogus'", "one of endpoint, local, none"]),
    ("reward.judge.kind=endpoint", ["reward.judge.kind=endpoint needs reward.judge.url", "http://localhost:8000/v1"]),
    ("reward.judge.kind=local", ["reward.judge.kind=local needs reward.judge.model"]),
])
def test_wrong_types_and_ranges_fail_in_one_sentence_naming_the_key(override, words):
    with pytest.raises(UserError) as error:
        load_config("train", [override])
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_settings_are_declared_once_and_train_yaml_uses_them():
    from dataclasses import asdict

    from gpg_vl.config.schema import EvalSettings, RolloutSettings, TrainerSettings

    raw = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())
    assert "train_schema" in raw["defaults"] and not {"trainer", "rollout", "eval"} & set(raw)  # no second copy
    cfg = load_config("train", [])
    task = yaml.safe_load((ROOT / "configs" / "task" / "shapes.yaml").read_text())  # the default task's own values
    for section, declared in (("trainer", TrainerSettings()), ("rollout", RolloutSettings()),
                              ("eval", EvalSettings())):
        expected = {**asdict(declared), **(task.get(section) or {})}
        assert OmegaConf.to_container(cfg[section]) == expected
    assert isinstance(OmegaConf.to_object(cfg.trainer), TrainerSettings)


def test_eval_yaml_is_typed_by_the_same_settings():
    from dataclasses import asdict

    from gpg_vl.config.schema import EvalSettings

    raw = yaml.safe_load((ROOT / "configs" / "eval.yaml").read_text())
    assert "eval_schema" in raw["defaults"] and not {"rollout", "eval"} & set(raw)  # no second copy
    task = yaml.safe_load((ROOT / "configs" / "task" / "shapes.yaml").read_text())
    cfg = load_config("eval", [])
    assert OmegaConf.to_container(cfg.eval) == {**asdict(EvalSettings()), **(task.get("eval") or {})}
    for override, words in (("eval.batch_size=abc", ["eval.batch_size=abc", "a whole number"]),
                            ("eval.reward_workers=0", ["eval.reward_workers=0", ">= 1"]),
                            ("segmenter=mask", ["segmenter='mask'", "one of box, sam, sam2"]),
                            ("rollout.hf.decode=fast", ["rollout.hf.decode='fast'", "one of"]),
                            ("eval.bogus=1", ["unknown config key 'eval.bogus'", "eval.reward_budget_s"])):
        with pytest.raises(UserError) as error:
            load_config("eval", [override])
        message = str(error.value)
        assert "\n" not in message and all(w in message for w in words), message


def test_every_model_alias_resolves_and_is_a_short_diff_over_the_schema_defaults(model_aliases):
    from dataclasses import asdict

    from gpg_vl.config.compose import group_options
    from gpg_vl.config.schema import ModelSettings

    defaults = asdict(ModelSettings())  # the one home of the model defaults
    for alias in group_options("model"):
        if alias == "local":
            continue
        raw = yaml.safe_load((ROOT / "configs" / "model" / f"{alias}.yaml").read_text())
        assert raw.pop("defaults", ["_tiny", "_self_"]) == ["_tiny", "_self_"] and len(raw) <= 3, alias
        assert all(key in defaults and value != defaults[key] for key, value in raw.items()), alias  # what differs
        model = model_aliases[alias]
        assert model.name_or_path and model.family and model.dtype in ("auto", "float32"), alias
    printed = subprocess.run([sys.executable, "scripts/train.py", "model=qwen3.5-35b-a3b", "--cfg", "job"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert "name_or_path: Qwen/Qwen3.5-35B-A3B" in printed.stdout and "family: qwen3_5" in printed.stdout


def test_an_error_during_a_step_is_printed_on_its_own_line_not_on_the_progress_bar(tmp_path, capsys, monkeypatch):
    from helpers.runs import QUICK_RUN

    from gpg_vl.train import loop

    def failing(run):
        raise UserError("trainer.advantage=mine gave no advantage for a group; fix the plugin.")

    monkeypatch.setattr(loop, "step", failing)
    code = run_cli("train", train_main, [f"output_dir={tmp_path}", *QUICK_RUN, "trainer.max_steps=2"])
    err = capsys.readouterr().err
    assert code == 2 and "0/2" in err  # the bar was drawn
    assert "error: trainer.advantage=mine gave no advantage for a group; fix the plugin.\n" in err.split("\r")[-1]
    assert [line for line in err.split("\n") if "error:" in line] == [
        "error: trainer.advantage=mine gave no advantage for a group; fix the plugin."]


def test_a_value_typed_on_the_command_line_is_never_replaced_by_a_config_group_without_a_word(capsys):
    assert load_config("train", ["task=geoqa"]).trainer.epochs == 1  # the task's run length, nothing typed
    typed = load_config("train", ["task=geoqa", "trainer.max_steps=3"]).trainer
    assert (typed.max_steps, typed.epochs) == (3, None)  # the typed value wins: 3 steps, not geoqa's one epoch
    assert capsys.readouterr().err == ""
    both = load_config("train", ["task=geoqa", "trainer.max_steps=3", "trainer.epochs=2"]).trainer
    assert (both.max_steps, both.epochs) == (3, 2)
    assert capsys.readouterr().err.splitlines() == [
        "note: trainer.epochs=2.0 replaces trainer.max_steps=3, both given on the command line: passes over the train "
        "split decide the run's length (drop trainer.epochs to use trainer.max_steps)."]


def test_a_config_that_does_not_compose_is_said_once_per_machine_under_a_launch(monkeypatch, capsys):
    """Under `accelerate launch` every process composes the same config: the first process of each machine
    (LOCAL_RANK 0) says the sentence, the others exit 2 without a word once the launcher ends them."""
    import gpg_vl.config.compose as compose

    monkeypatch.setattr(compose, "QUIET_RANK_WAIT_S", 0.0)
    bad = ["rollout.vllm_server.urls=http://127.0.0.1:70000", "rollout.engine=vllm_server"]
    first = "error: rollout.vllm_server.urls holds 'http://127.0.0.1:70000', whose port 70000 is not a port"
    for rank, said in (("1", ""), ("7", ""), ("0", first), (None, "error: ")):
        if rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", rank)
        assert compose.run_cli("train", lambda cfg: pytest.fail("composed"), bad) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == (1 if said else 0), (rank, err)
