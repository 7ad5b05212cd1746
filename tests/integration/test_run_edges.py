"""Hostile probes of a run's edges (issue 28): Ctrl-C, evaluation off with no held-out split, DAPO's overlong
cache past the length limit, the progress bar's label, the non-finite reward warning."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import QUICK_RUN as TINY
from PIL import Image

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.errors import UserError
from gpg_vl.train import loop, step_log
from gpg_vl.train.checkpoint.outdir import LOCK_FILE, claim_output_dir


def test_ctrl_c_ends_the_run_in_one_line_naming_the_step_and_the_checkpoint_and_frees_the_folder(tmp_path,
                                                                                                 monkeypatch, capsys):
    real_step, calls = loop.step, []

    def interrupted_at_step_2(run):
        calls.append(run.state.step)
        if len(calls) == 2:
            run.state.step += 1  # as the real step counts the step it starts
            raise KeyboardInterrupt
        return real_step(run)

    monkeypatch.setattr(loop, "step", interrupted_at_step_2)
    code = run_cli("train", train_main, [f"output_dir={tmp_path}", *TINY, "trainer.max_steps=3"])
    err = capsys.readouterr().err.strip()  # the progress bars, then the one line
    assert code == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"interrupted at step 2; continue with resume=auto (output_dir={tmp_path}; "
                                    f"the newest intact checkpoint is {tmp_path / 'checkpoint-1'}).")
    assert not (tmp_path / LOCK_FILE).exists()  # released
    with claim_output_dir(tmp_path, resume="auto"):  # free: another run may take it
        pass
    monkeypatch.undo()
    summary = train_main(load_config("train", [f"output_dir={tmp_path}", *TINY, "trainer.max_steps=2",
                                               "resume=auto"]))  # what the sentence says to do works
    assert summary["steps"] == 2


def test_ctrl_c_before_training_starts_says_nothing_was_trained(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("gpg_vl.train.build.build_policy", interrupted)
    assert run_cli("train", train_main, [f"output_dir={tmp_path}", *TINY, "trainer.max_steps=1"]) == 130
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"interrupted before training started; nothing was trained in {tmp_path}."
    with claim_output_dir(tmp_path):  # the folder's claim was released
        pass


def test_a_run_with_evaluation_off_never_reads_the_held_out_split(tmp_path):
    data = tmp_path / "data"  # geoqa's jsonl layout, a train split only (no test.jsonl)
    (data / "images").mkdir(parents=True)
    lines = []
    for i, answer in enumerate(["3", "5", "7", "9"]):
        Image.new("RGB", (72, 60), (40 * i, 120, 200)).save(data / "images" / f"{i}.png")
        lines.append(json.dumps({"image_path": f"images/{i}.png", "question": f"Find x{i}.", "ground_truth": answer}))
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    summary = train_main(load_config("train", [f"output_dir={tmp_path / 'run'}", *TINY, "task=geoqa",
                                               f"data.path={data}", "trainer.epochs=null", "trainer.max_steps=1",
                                               "trainer.save_every=0"]))
    assert summary["steps"] == 1 and summary.get("accuracy_before") is None


def test_an_overlong_cache_past_the_length_limit_is_refused_with_the_config():
    with pytest.raises(UserError) as error:
        load_config("train", ["algorithm=dapo", "trainer.overlong_cache=100", "rollout.max_new_tokens=12"])
    message = str(error.value)
    assert "trainer.overlong_cache=100 above rollout.max_new_tokens=12" in message and "\n" not in message
    assert load_config("train", ["algorithm=dapo", "trainer.overlong_cache=12", "rollout.max_new_tokens=12"])


def test_the_progress_bar_shows_a_losss_short_name():
    assert loop.bar_label("gpg") == "GPG" and loop.bar_label("dr_grpo") == "DR_GRPO"
    assert loop.bar_label("path/to/my_losses.py:clipped") == "clipped"
    assert loop.bar_label("my_package.losses:clipped") == "clipped"


def fake_run(processes: int, seen: dict | None = None):
    task = SimpleNamespace() if seen is None else SimpleNamespace(reward_nonfinite=seen)
    return SimpleNamespace(data=SimpleNamespace(task=task), accelerator=SimpleNamespace(num_processes=processes))


def test_a_non_finite_reward_is_named_and_another_process_blamed_only_when_there_is_one():
    nan = [SimpleNamespace(components={"odd": torch.tensor([[float("nan"), 1.0]]), "ok": torch.ones(1, 2)})]
    assert step_log._nonfinite_rewards(fake_run(1), nan) == "reward odd"  # from the completions' components
    assert step_log._nonfinite_rewards(fake_run(1, {"len": 2}), []) == "reward len"  # from the task's count
    fine = [SimpleNamespace(components={"ok": torch.ones(1, 2)})]
    assert "another process" not in step_log._nonfinite_rewards(fake_run(1), fine)
    assert step_log._nonfinite_rewards(fake_run(2), fine) == "on another process"


def test_an_overlong_cache_past_a_trajectorys_limit_is_refused_with_the_config():
    with pytest.raises(UserError) as error:
        load_config("train", ["algorithm=dapo", "trainer.overlong_cache=16", "rollout.max_new_tokens=32",
                              "rollout.max_turns=2", "rollout.max_total_tokens=8"])
    assert "trainer.overlong_cache=16 above rollout.max_total_tokens=8 with rollout.max_turns=2" in str(error.value)
