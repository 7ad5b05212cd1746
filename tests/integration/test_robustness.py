"""Runs that never lose work (issue 15): one run per output folder, checked resumes, damaged checkpoints, values
checked before the model loads, a run's record across resumes, and slow rewards that cannot stall a step."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.runs import train_run as run
from safetensors.torch import load_file

from gpg_vl.cli import eval_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.errors import UserError
from gpg_vl.reward.pool import RewardBudget, score_completions
from gpg_vl.train.checkpoint import outdir, save
from gpg_vl.train.checkpoint.folder import MARKER_FILE, STATE_FILE, resolve_resume, verify_checkpoint
from gpg_vl.train.checkpoint.outdir import LOCK_FILE, claim_output_dir
from gpg_vl.train.checkpoint.resume import load_trainer_state

ROOT = Path(__file__).resolve().parents[2]


def one_sentence(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message.endswith("."), message
    return message


def final_weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


# ---------------------------------------------------------------------------------------------
# 1. an output folder belongs to one run
# ---------------------------------------------------------------------------------------------
HOLD = """
import sys
from gpg_vl.train.checkpoint.outdir import claim_output_dir


with claim_output_dir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_run_on_a_held_folder_fails_naming_the_holder_and_a_killed_holder_never_blocks(tmp_path, no_model,
                                                                                                 capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as error:
            run(out, "trainer.max_steps=1")
        message = one_sentence(error)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message and "in use by another run" in message
        assert not list(out.glob("*.jsonl"))  # the holder's folder is untouched
    finally:
        holder.kill()  # SIGKILL: the holder never releases the lock itself
        holder.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid  # the killed run's record stays
    with pytest.raises(AssertionError, match="model was loaded"):  # the lock is free: the run gets to its model
        run(out, "trainer.max_steps=1")
    assert f"took over {out / LOCK_FILE} from pid {holder.pid}" in capsys.readouterr().out


def test_the_lock_is_held_for_the_whole_run_and_released_at_its_end(tmp_path, monkeypatch):
    write, refusals = save._write_trainer_state, []

    def try_to_take_the_lock(folder, state):  # mid-run, during the save of checkpoint-1
        with pytest.raises(UserError) as error:
            outdir._lock(tmp_path, print)  # another open file, as another process would hold
        refusals.append(str(error.value))
        write(folder, state)

    monkeypatch.setattr(save, "_write_trainer_state", try_to_take_the_lock)
    run(tmp_path, "trainer.max_steps=1")
    assert refusals and all(f"in use by another run (pid {os.getpid()} on host" in r for r in refusals)
    assert not (tmp_path / LOCK_FILE).exists()  # a clean release removes the lock file
    with claim_output_dir(tmp_path, resume="auto"):  # free again
        pass


def test_a_run_that_fails_before_training_leaves_no_empty_folder_and_a_folder_with_files_is_kept(tmp_path,
                                                                                                 no_model):
    fresh = tmp_path / "outputs" / "2026-12-03_00-30-00"  # a timestamped folder the run creates
    with pytest.raises(AssertionError, match="model was loaded"):
        run(fresh, "trainer.max_steps=1")
    assert not fresh.exists() and (tmp_path / "outputs").is_dir()
    mine = tmp_path / "mine"
    mine.mkdir()  # a folder the user made is theirs: kept, empty
    with pytest.raises(AssertionError, match="model was loaded"):
        run(mine, "trainer.max_steps=1")
    assert mine.is_dir() and not list(mine.iterdir())


def test_a_run_waiting_on_a_lock_file_its_holder_removes_locks_the_new_file(tmp_path, monkeypatch):
    path = tmp_path / LOCK_FILE
    with claim_output_dir(tmp_path):
        stale = os.open(path, os.O_RDWR)  # opened by a second run while the first holds it
    assert not path.exists()  # released: removed while still locked
    real_open, opened = os.open, []

    def first_the_stale_file(*args, **kwargs):  # the second run's open came before the release
        opened.append(args[0])
        return stale if len(opened) == 1 else real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", first_the_stale_file)
    with claim_output_dir(tmp_path):
        monkeypatch.undo()
        assert len(opened) == 2  # the stale file was let go, the new one locked
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(UserError, match="in use by another run"):
            outdir._lock(tmp_path, print)


def test_without_flock_a_lock_is_judged_by_its_holders_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(outdir, "fcntl", None)  # a file system (or OS) without flock
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {"pid": sleeper.pid, "host": socket.gethostname()}
        (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
        with pytest.raises(UserError, match=f"in use by another run \\(pid {sleeper.pid} on host"):
            claim_output_dir(tmp_path).__enter__()
    finally:
        sleeper.kill()
        sleeper.wait()
    warnings = []
    with claim_output_dir(tmp_path, warn=warnings.append):  # the same pid, no longer running: taken over
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"from pid {sleeper.pid} on host" in warnings[0] and "ended without releasing it" in warnings[0]
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(UserError, match="pid 1 on host another-host"):  # cannot be checked from here: kept
        claim_output_dir(tmp_path).__enter__()


def test_a_new_run_refuses_a_folder_holding_a_previous_run_and_overwrite_moves_it_aside(tmp_path, no_model):
    (tmp_path / "checkpoint-7").mkdir()
    (tmp_path / "checkpoint-7" / "model.safetensors").write_bytes(b"old weights")
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=1")
    message = one_sentence(error)
    assert "holds a previous run (checkpoint-7, metrics.jsonl)" in message
    assert "resume=auto" in message and "overwrite=true" in message
    with pytest.raises(UserError, match="cannot also continue"):
        run(tmp_path, "overwrite=true", "resume=auto")
    with pytest.raises(AssertionError, match="model was loaded"):
        run(tmp_path, "overwrite=true")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and [p.name for p in tmp_path.iterdir()] == [aside[0].name]  # the lock released
    assert (aside[0] / "checkpoint-7" / "model.safetensors").read_bytes() == b"old weights"  # moved, not deleted
    assert (aside[0] / "metrics.jsonl").read_text() == '{"step": 7}\n'


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step run with checkpoint-1, checkpoint-2 and final/ (read-only for the tests: copy it)."""
    out = tmp_path_factory.mktemp("two_steps")
    run(out, "trainer.max_steps=2", "trainer.eval_before=true", "eval.limit=4", "eval.batch_size=4")
    return out


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(LOCK_FILE))
    return target


@pytest.mark.parametrize("change, key, before, after", [
    ("trainer.group_size=2", "trainer.group_size", "4", "2"),
    ("trainer.batch_size=8", "trainer.batch_size", "4", "8"),
    ("model.lora.r=4", "model.lora.r", "0", "4"),
    ("model.freeze_vision=true", "model.freeze_vision", "False", "True"),
    ("model.family=qwen2_vl", "model.family", "'qwen2_5_vl'", "'qwen2_vl'"),
    ("task=helpers.vowel_task:Vowels", "task.name", "'shapes'", "'helpers.vowel_task:Vowels'"),
])
def test_resume_refuses_settings_that_change_what_the_checkpoint_means(two_steps, tmp_path, no_model, change, key,
                                                                       before, after):
    out = copy_run(two_steps, tmp_path / "run")
    with pytest.raises(UserError) as error:
        run(out, "resume=auto", "trainer.max_steps=3", change)
    message = one_sentence(error)
    assert f"with {key}={before}, this run sets {key}={after}" in message


def test_resume_accepts_legitimate_changes_and_says_what_changed(two_steps, tmp_path, no_model, capsys):
    out = copy_run(two_steps, tmp_path / "run")
    with pytest.raises(AssertionError, match="model was loaded"):  # accepted: the run goes on to load the model
        run(out, "resume=auto", "trainer.max_steps=3", "trainer.lr=0.0002", "model.family=qwen2_5_vl")
    said = capsys.readouterr().out
    assert "checkpoint-2 with changed settings: " in said and "model.family" not in said
    assert "trainer.eval_before: True -> False; trainer.lr: 0.0001 -> 0.0002; trainer.max_steps: 2 -> 3\n" in said


# ---------------------------------------------------------------------------------------------
# 2. damaged checkpoints
# ---------------------------------------------------------------------------------------------
def test_checkpoint_json_records_each_files_size_and_sha256(two_steps):
    marker = json.loads((two_steps / "checkpoint-2" / MARKER_FILE).read_text())
    files = {p.name for p in (two_steps / "checkpoint-2").iterdir()} - {MARKER_FILE}
    assert set(marker["files"]) == files and {"model.safetensors", STATE_FILE} <= files
    entry = marker["files"]["model.safetensors"]
    assert entry["size"] == (two_steps / "checkpoint-2" / "model.safetensors").stat().st_size
    assert len(entry["sha256"]) == 64 and marker["config"]["trainer"]["group_size"] == 4
    assert verify_checkpoint(two_steps / "checkpoint-2") is None


def test_resume_auto_falls_back_past_damaged_checkpoints_and_continues_exactly(two_steps, tmp_path, capsys):
    out = copy_run(two_steps, tmp_path / "run")
    expected = final_weights(two_steps / "final")
    weights = out / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    (out / "final" / "model.safetensors").write_bytes(b"")  # empty
    state = out / "checkpoint-1" / STATE_FILE
    warnings = []
    assert resolve_resume("auto", out, warn=warnings.append) == out / "checkpoint-1"
    assert "checkpoint-2, which is damaged (model.safetensors has" in warnings[0]
    assert "final, which is damaged (model.safetensors has 0 bytes" in warnings[1]
    with pytest.raises(UserError) as error:
        resolve_resume(str(out / "checkpoint-2"), out)
    assert "is damaged (model.safetensors has" in one_sentence(error)

    run(out, "resume=auto", "trainer.max_steps=2")  # from checkpoint-1, to the same weights as the intact run
    said = capsys.readouterr().out
    assert "resumed from" in said and "checkpoint-1 at step 1" in said
    resumed = final_weights(out / "final")
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    assert state.is_file() and verify_checkpoint(out / "final") is None

    flipped = bytearray(state.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # same size, other bytes
    state.write_bytes(bytes(flipped))
    assert verify_checkpoint(out / "checkpoint-1") == f"{STATE_FILE} does not match the sha256 it was " \
                                                       "written with"


def test_a_trainer_state_lacking_keys_fails_in_one_sentence(tmp_path):
    save._write_trainer_state(tmp_path, {"step": 1, "optimizer": None, "scheduler": {}})
    with pytest.raises(UserError) as error:
        load_trainer_state(tmp_path, None, None, None)
    assert "lacks data, rng" in one_sentence(error)
    save._write_trainer_state(tmp_path, {"step": 1, "optimizer": None, "scheduler": {}, "data": {},
                                               "rng": []})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    from gpg_vl.data.stream import PromptStream

    with pytest.raises(UserError) as error:  # `data` without its keys: a KeyError inside, one sentence outside
        load_trainer_state(tmp_path, optimizer, scheduler, PromptStream([1, 2], seed=0))
    assert "does not fit this run (KeyError" in one_sentence(error)


# ---------------------------------------------------------------------------------------------
# 3. values checked before anything loads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, says", [
    (["trainer.lr=abc"], "trainer.lr=abc has the wrong type: trainer.lr takes a number"),  # the schema's types
    (["trainer.lr=-1"], "trainer.lr=-1.0, allowed: a number > 0"),
    (["trainer.group_size=0"], "trainer.group_size=0, allowed: an integer >= 1"),
    (["trainer.group_size=2.5"], "trainer.group_size=2.5 has the wrong type: trainer.group_size takes a whole number"),
    (["trainer.group_size=1"], "trainer.group_size=1, allowed: an integer >= 2 with a group baseline"),
    (["trainer.max_steps=abc"], "trainer.max_steps=abc has the wrong type: trainer.max_steps takes a whole number"),
    (["trainer.max_steps=-5"], "trainer.max_steps=-5, allowed: an integer >= 1"),
    (["trainer.epochs=abc"], "trainer.epochs=abc has the wrong type: trainer.epochs takes a number"),
    (["trainer.lr_schedule=bogus"], "trainer.lr_schedule='bogus', allowed: one of linear, cosine"),
    (["trainer.aggregation=bogus"], "trainer.aggregation='bogus', allowed: one of seq_mean_token_mean, "
                                    "seq_mean_token_sum, seq_token_sum, token_mean"),
    (["trainer.micro_batch_size=0", "trainer.micro_batch_tokens=0"], "trainer.micro_batch_size=0 with "
                                                                      "trainer.micro_batch_tokens=0"),
    (["trainer.max_attempts=0"], "trainer.max_attempts=0, allowed: an integer >= 1"),
    (["trainer.report_to=bogus"], "trainer.report_to='bogus', allowed: one of none, "),
    (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints=-1, allowed: an integer >= 0"),
    (["trainer.save_every=-1"], "trainer.save_every=-1, allowed: an integer >= 0"),
    (["trainer.reward_budget_s=-1"], "trainer.reward_budget_s=-1.0, allowed: a number >= 0"),
    (["rollout.max_new_tokens=-1"], "rollout.max_new_tokens=-1, allowed: an integer >= 1"),
    (["rollout.temperature=0"], "rollout.temperature=0.0, allowed: a number > 0"),
    (["seed=abc"], "seed=abc has the wrong type: seed takes a whole number"),
    (["trainer.clip_cov_bounds=abc"], "trainer.clip_cov_bounds=abc has the wrong type: trainer.clip_cov_bounds takes "
                                      "a list ([a, b, ...])"),  # was Hydra's bare "Error merging override" (issue 59)
    (["trainer.loss_options=abc"], "trainer.loss_options=abc has the wrong type: trainer.loss_options takes a map "
                                   "({key: value, ...})"),
    (["model.dtype=int8"], "model.dtype='int8', allowed: one of auto, float32, bfloat16, float16"),
    (["eval.batch_size=0"], "eval.batch_size=0, allowed: an integer >= 1"),
    (["trainer.lr=-1", "eval.batch_size=0"], "values: trainer.lr=-1.0, allowed: a number > 0; eval.batch_size=0"),
])
def test_bad_values_fail_in_one_sentence_before_anything_loads(overrides, says, capsys):
    def main(cfg):
        raise AssertionError("reached the run")

    assert run_cli("train", main, overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and says in err, err


def test_eval_checks_the_same_values():
    with pytest.raises(UserError, match=r"eval.batch_size=0, allowed: an integer >= 1"):
        load_config("eval", ["eval.batch_size=0"])
    assert load_config("train", ["trainer.group_size=1", "trainer.baseline=none"]).trainer.group_size == 1


def broken_model(tmp_path, edit) -> Path:
    folder = shutil.copytree(ROOT / "gpg_vl" / "assets" / "tiny-qwen2.5-vl", tmp_path / "model")
    config = folder / "config.json"
    config.write_text(edit(config.read_text()))
    return folder


@pytest.mark.parametrize("edit, says", [
    (lambda text: text[: len(text) // 2], "has a config.json that transformers cannot read"),
    (lambda text: text.replace('"image_token_id": 399', '"image_token_id": "399"'), "image_token_id"),
    (lambda text: text.replace('"hidden_size": 192', '"hidden_size": "big"'), "hidden_size"),
])
def test_a_model_folder_with_a_broken_config_fails_before_the_weights_load(tmp_path, no_model, edit, says):
    folder = broken_model(tmp_path, edit)
    with pytest.raises(UserError) as error:
        run(tmp_path / "run", f"model={folder}", "trainer.max_steps=1")
    assert says in one_sentence(error) and str(folder) in str(error.value)


def test_a_model_family_contradicting_the_models_config_fails(tmp_path, no_model):
    folder = broken_model(tmp_path, lambda text: text)
    with pytest.raises(UserError) as error:
        run(tmp_path / "run", f"model.name_or_path={folder}", "model.family=qwen3_vl", "trainer.max_steps=1")
    assert "model.family=qwen3_vl contradicts" in one_sentence(error) and "'qwen2_5_vl'" in str(error.value)


def test_an_output_dir_that_is_a_file_or_read_only_fails_before_the_model_loads(tmp_path, no_model, monkeypatch):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(UserError) as error:
        run(file, "trainer.max_steps=1")
    assert "is an existing file, not a folder" in one_sentence(error)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the file system's answer is simulated
        write = Path.write_bytes

        def refuse(self, data):
            if self.parent == read_only:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return write(self, data)

        monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(UserError) as error:
        run(read_only, "trainer.max_steps=1")
    assert "is not writable (Permission denied)" in one_sentence(error)
    with pytest.raises(UserError, match="is not writable"):
        eval_main(load_config("eval", [f"output_dir={read_only}"]))


def test_a_full_disk_during_a_save_fails_in_one_sentence_naming_the_intact_checkpoint(tmp_path, monkeypatch):
    write = save._write_trainer_state

    def disk_full_at_step_2(folder, state):
        if state["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(folder, state)

    monkeypatch.setattr(save, "_write_trainer_state", disk_full_at_step_2)
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=3")
    message = one_sentence(error)
    assert "could not save checkpoint-2" in message and "the disk is full (No space left on device)" in message
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-1'}" in message
    assert not list(tmp_path.glob("*.partial"))  # the failed save's files are gone: they took the space


def fill_the_disk_on(monkeypatch, name: str, mode: str, at_call: int) -> None:
    """`Path.open(name, mode)` raises ENOSPC from its `at_call`-th call on, as a full disk does."""
    opened, calls = Path.open, []

    def full(self, *args, **kwargs):
        if self.name == name and (args[0] if args else kwargs.get("mode", "r")) == mode:
            calls.append(self)
            if len(calls) >= at_call:
                raise OSError(errno.ENOSPC, "No space left on device")
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full)


def test_a_full_disk_while_appending_metrics_fails_in_one_sentence_and_the_run_continues(tmp_path, monkeypatch):
    fill_the_disk_on(monkeypatch, "metrics.jsonl", "a", at_call=2)
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=3")
    message = one_sentence(error)
    assert "could not append step 2 to metrics.jsonl" in message and "the disk is full" in message
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-1'}" in message
    monkeypatch.undo()  # space freed: the run continues from checkpoint-1 and its metrics have every step once
    run(tmp_path, "trainer.max_steps=3", "resume=auto")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_full_disk_while_writing_the_summary_keeps_the_old_one_and_names_the_intact_checkpoint(tmp_path, monkeypatch):
    run(tmp_path, "trainer.max_steps=1")
    before = (tmp_path / "summary.json").read_text()
    write = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "summary.json.partial":
            write(self, "{\"cut")  # the disk fills halfway through
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=2", "resume=auto")
    message = one_sentence(error)
    assert "could not write summary.json" in message and f"intact checkpoint is {tmp_path / 'checkpoint-2'}" in message
    assert (tmp_path / "summary.json").read_text() == before and not (tmp_path / "summary.json.partial").exists()


def test_a_full_disk_while_writing_evaluation_results_fails_in_one_sentence(tmp_path, monkeypatch):
    fill_the_disk_on(monkeypatch, "predictions.jsonl", "w", at_call=1)
    with pytest.raises(UserError) as error:
        eval_main(load_config("eval", [f"output_dir={tmp_path}", "eval.limit=4", "eval.batch_size=4"]))
    message = one_sentence(error)
    assert "could not write the evaluation's results" in message and "the disk is full" in message
    assert "accuracy was" in message

# ---------------------------------------------------------------------------------------------
# 5. the run's record survives a resume
# ---------------------------------------------------------------------------------------------
def test_the_summary_keeps_the_first_evaluation_and_adds_up_training_time_across_resumes(two_steps, tmp_path):
    out = copy_run(two_steps, tmp_path / "run")
    first = json.loads((out / "summary.json").read_text())
    assert first["accuracy_before"] is not None and first["eval_before"]
    run(out, "resume=auto", "trainer.max_steps=3", "trainer.eval_before=true", "eval.limit=4", "eval.batch_size=4")
    (out / "curves.png").unlink()
    run(out, "resume=auto", "trainer.max_steps=3")  # nothing left to train: still a full record
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3] and summary["steps"] == 3
    assert summary["eval_before"] == first["eval_before"] and summary["accuracy_before"] == first["accuracy_before"]
    assert summary["train_seconds"] == pytest.approx(sum(m["step_s"] for m in steps), rel=1e-9)
    assert summary["train_seconds"] > first["train_seconds"] > 0
    assert (out / "curves.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# 6. slow rewards do not stall a step
# ---------------------------------------------------------------------------------------------
class Scored:
    """A stand-in task: reward 'len' is the completion's length; completions starting 'slow' block."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reward_functions = {"len": None, "one": None}

    def scored_components(self, completion, row):
        if completion.startswith("slow"):
            self.release.wait()
        return {"len": float(len(completion)), "one": 1.0}, 0


def test_completions_not_scored_within_the_budget_score_zero_and_are_counted():
    task = Scored()
    texts = ["a", "slow1", "bb", "slow2", "ccc", "dddd"]
    try:
        scores, timeouts, *_ = score_completions(task, texts, [{}] * 6, workers=3, budget=RewardBudget(2.0))
    finally:
        task.release.set()
    assert timeouts == 2  # the two slow ones hold two workers; the third scores the rest
    assert scores == [{"len": 1.0, "one": 1.0}, {"len": 0.0, "one": 0.0}, {"len": 2.0, "one": 1.0},
                      {"len": 0.0, "one": 0.0}, {"len": 3.0, "one": 1.0}, {"len": 4.0, "one": 1.0}]
    plenty = RewardBudget(0)  # no limit
    assert score_completions(task, texts, [{}] * 6, workers=4, budget=plenty) == (
        [{"len": float(len(t)), "one": 1.0} for t in texts], 0, 0, 0, 0)


def test_one_worker_scores_in_this_thread_until_the_budget_is_spent(monkeypatch):
    clock = iter(range(100))  # each reading of the clock is one second later
    monkeypatch.setattr("gpg_vl.reward.pool.time.monotonic", lambda: float(next(clock)))
    task, seen = Scored(), []
    task.scored_components = lambda c, r: (seen.append(threading.current_thread()), ({"len": 1.0, "one": 1.0}, 0))[1]
    budget = RewardBudget(3.5)
    scores, timeouts, *_ = score_completions(task, ["x"] * 6, [{}] * 6, workers=1, budget=budget)
    # start at t=0; completions checked at t=1, 2, 3 are scored, those at t=4, 5, 6 are past the budget
    assert timeouts == 3 and [s["one"] for s in scores] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert seen == [threading.main_thread()] * 3 and budget.left < 0


def test_a_step_with_a_reward_that_never_returns_goes_on_and_counts_it(tmp_path):
    from helpers import slow_task

    slow_task.RELEASE.clear()  # blocked until this test is done (an earlier test may have released it)
    try:
        summary = run(tmp_path, "task=helpers.slow_task:SlowVowels", "trainer.max_steps=2", "trainer.save_every=0",
                      "trainer.max_attempts=1", "trainer.reward_workers=8", "trainer.reward_budget_s=3")
    finally:
        slow_task.RELEASE.set()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # 4 prompts a step (the task's 4 rows, each drawn once per step), 4 completions each: row 0's 4 never return
    assert [m["reward_timeouts"] for m in lines] == [4, 4] and summary["reward_timeouts"] == 8


def test_evaluation_scores_each_completion_once_on_threads_within_its_budget(tmp_path, capsys):
    from helpers import slow_task

    slow_task.RELEASE.clear()
    try:
        metrics = eval_main(load_config("eval", [f"output_dir={tmp_path}", "task=helpers.slow_task:SlowVowels",
                                                 "eval.batch_size=4", "eval.reward_workers=4",
                                                 "eval.reward_budget_s=2", "rollout.max_new_tokens=8"]))
    finally:
        slow_task.RELEASE.set()
    assert metrics["reward_timeouts"] == 1.0  # held-out row 1000's reward never returns: scored 0, counted
    assert "1 of 4 held-out completions were not scored within eval.reward_budget_s=2" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert records[0]["rewards"] == {"vowels": 0.0}
    assert [r["rewards"]["vowels"] for r in records[1:]] == [slow_task.vowel_share(r["completion"])
                                                              for r in records[1:]]
    assert metrics["reward/vowels"] == pytest.approx(sum(r["rewards"]["vowels"] for r in records) / 4)
