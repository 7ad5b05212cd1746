"""Hostile probes of issue 28: a full disk while a checkpoint is written (as torch.save and safetensors report
it, not as an OSError), `resume=auto` on a full disk, `resume=auto` over a run whose checkpoint.json files are
all gone, and model folders holding only a pickled pytorch_model.bin or no tokenizer."""

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers.runs import train_run as run
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpg_vl.errors import UserError
from gpg_vl.train.checkpoint.folder import MARKER_FILE, STATE_FILE, checkpoint_step, verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# What the writers say when the disk fills (issue 28's probes): torch.save's zip writer finds its file shorter
# than what it wrote; safetensors passes the OS error on in its own exception type.
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 20971520 vs 20971419"
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def one_sentence(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message.endswith("."), message
    return message


# ---------------------------------------------------------------------------------------------
# a full disk while a checkpoint is written
# ---------------------------------------------------------------------------------------------
def test_torch_save_cut_short_by_a_full_disk_ends_the_run_in_one_sentence(tmp_path, monkeypatch):
    """A small disk where checkpoint-2's weights fit and its trainer state does not (torch.save's message)."""
    save = torch.save

    def full_at_step_2(obj, file, *args, **kwargs):
        if Path(file).name == STATE_FILE and obj.get("step") == 2:
            Path(file).write_bytes(b"PK\x03\x04 cut")  # what it wrote before the disk filled
            raise RuntimeError(TORCH_FULL)
        return save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=3")
    message = one_sentence(error)
    assert "could not save checkpoint-2" in message and "cut short, most often by a full disk" in message
    assert "unexpected pos" in message
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-1'}" in message
    assert not list(tmp_path.glob("*.partial"))  # the failed save's files are gone: they took the space
    assert verify_checkpoint(tmp_path / "checkpoint-1") is None


def test_safetensors_on_a_full_disk_ends_the_run_in_one_sentence(tmp_path, monkeypatch):
    import transformers.modeling_utils

    saved = []

    def full_at_the_second_save(*args, **kwargs):
        saved.append(1)
        if len(saved) >= 2:
            raise SafetensorError(SAFETENSORS_FULL)
        return save(*args, **kwargs)

    save = transformers.modeling_utils.safe_save_file
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_at_the_second_save)
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=3")
    message = one_sentence(error)
    assert "could not save checkpoint-2" in message
    assert "the disk is full (SafetensorError: " in message and "No space left on device" in message
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-1'}" in message
    assert not list(tmp_path.glob("*.partial"))


def test_resume_auto_on_a_full_disk_says_so_in_one_sentence(tmp_path, monkeypatch):
    run(tmp_path, "trainer.max_steps=1")
    pwrite = os.pwrite

    def full(descriptor, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr("gpg_vl.train.build.build_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError) as error:
        run(tmp_path, "trainer.max_steps=2", "resume=auto")
    message = one_sentence(error)
    assert "could not take run.lock" in message and "the disk is full (No space left on device)" in message
    assert f"newest intact checkpoint, {tmp_path / 'checkpoint-1'}, is untouched" in message
    assert "resume=auto" in message
    monkeypatch.setattr(os, "pwrite", pwrite)


# ---------------------------------------------------------------------------------------------
# resume=auto when no checkpoint is complete any more
# ---------------------------------------------------------------------------------------------
def test_resume_auto_without_any_intact_checkpoint_keeps_the_old_final_aside(tmp_path, capsys):
    run(tmp_path, "trainer.max_steps=1", "seed=5")
    old_weights = load_file(tmp_path / "final" / "model.safetensors")
    for marker in tmp_path.glob(f"*/{MARKER_FILE}"):
        marker.unlink()  # every checkpoint.json gone: nothing is complete
    run(tmp_path, "trainer.max_steps=1", "resume=auto")
    out = capsys.readouterr().out
    assert "no complete checkpoint" in out and "resume=auto starts over: moved the previous run's" in out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    kept = load_file(aside / "final" / "model.safetensors")  # the old final/, moved, not replaced
    assert kept.keys() == old_weights.keys() and all(torch.equal(kept[k], old_weights[k]) for k in kept)
    assert (aside / "metrics.jsonl").is_file() and (aside / "checkpoint-1").is_dir()
    assert checkpoint_step(tmp_path / "final") == 1  # the new run's own
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


# ---------------------------------------------------------------------------------------------
# model folders
# ---------------------------------------------------------------------------------------------
def tiny_copy(tmp_path) -> Path:
    return shutil.copytree(ROOT / "gpg_vl" / "assets" / "tiny-qwen2.5-vl", tmp_path / "model")


class _RunsCode:
    def __reduce__(self):  # unpickling this would run a command
        return (os.system, ("touch pwned",))


def test_a_model_folder_with_only_a_pickled_bin_is_refused_before_loading(tmp_path, no_model, monkeypatch):
    folder = tiny_copy(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _RunsCode()}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as error:
        run(tmp_path / "run", f"model={folder}", "trainer.max_steps=1")
    message = one_sentence(error)
    assert str(folder) in message and "only as pytorch_model.bin, a pickle" in message
    assert "runs whatever code it holds" in message and "convert it to safetensors" in message
    assert not (tmp_path / "pwned").exists()


def test_a_model_folder_without_tokenizer_files_is_refused_before_loading(tmp_path, no_model):
    folder = tiny_copy(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(UserError) as error:
        run(tmp_path / "run", f"model={folder}", "trainer.max_steps=1")
    message = one_sentence(error)
    assert str(folder) in message and "has no tokenizer files" in message and "copy the tokenizer files" in message
