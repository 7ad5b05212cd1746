"""Crash-safe checkpoints: what they hold, atomic writes, resume=auto, exact resume after a kill, safe loading."""

import importlib.util
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import procs
from helpers.runs import untimed
from transformers import AutoModelForImageTextToText, get_scheduler

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config
from gpg_vl.data.stream import PromptStream
from gpg_vl.errors import UserError
from gpg_vl.train.checkpoint import save
from gpg_vl.train.checkpoint.folder import MARKER_FILE, STATE_FILE, latest_checkpoint, remove_partials, resolve_resume
from gpg_vl.train.checkpoint.resume import load_trainer_state, set_rng_state, truncate_metrics
from gpg_vl.train.checkpoint.save import rng_state

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=4",
        "rollout.max_new_tokens=24", "trainer.save_every=1", "trainer.keep_checkpoints=2"]


def run(output_dir, *overrides):
    return train_main(load_config("train", [f"output_dir={output_dir}", *TINY, *overrides]))


def draws():
    return random.random(), float(np.random.rand()), float(np.random.standard_normal()), float(torch.rand(1))


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # numpy caches the second gaussian: part of its state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    draws()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


@pytest.mark.parametrize("schedule", ["constant", "constant_with_warmup", "cosine", "linear", "polynomial"])
def test_optimizer_and_scheduler_states_load_with_weights_only(tmp_path, schedule):
    weights = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(weights, lr=0.1)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=2, num_training_steps=10)
    weights[0].sum().backward()
    optimizer.step()
    scheduler.step()
    stream = PromptStream(list(range(7)), seed=0)
    stream.next_indices(3)
    save._write_trainer_state(tmp_path, {
        "step": 1, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "data": stream.state_dict(), "rng": [rng_state()], "counters": {"reward_errors": 2}})
    (tmp_path / MARKER_FILE).write_text(json.dumps({"step": 1}))

    fresh_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    fresh_scheduler = get_scheduler(schedule, fresh_optimizer, num_warmup_steps=2, num_training_steps=10)
    fresh_stream, counters = PromptStream(list(range(7)), seed=0), {}
    assert load_trainer_state(tmp_path, fresh_optimizer, fresh_scheduler, fresh_stream, counters=counters) == 1
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr() and counters == {"reward_errors": 2}
    moments = [o.state_dict()["state"][0]["exp_avg"] for o in (fresh_optimizer, optimizer)]
    assert torch.equal(*moments)
    assert fresh_stream.next_indices(4) == stream.next_indices(4)


class Payload:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_a_trainer_state_holding_pickled_objects_is_refused(tmp_path, capsys):
    with (tmp_path / STATE_FILE).open("wb") as handle:
        pickle.dump({"step": 1, "optimizer": Payload()}, handle, protocol=2)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(UserError, match=r"cannot read the trainer state .*trainer_state.pt"):
        load_trainer_state(tmp_path, optimizer, None, None)
    assert "unpickled code ran" not in capsys.readouterr().out


def make_checkpoint(folder: Path, step: int | None, state: bool = True) -> Path:
    folder.mkdir(parents=True)
    if state:
        (folder / STATE_FILE).write_bytes(b"state")
    if step is not None:
        (folder / MARKER_FILE).write_text(json.dumps({"step": step}))
    return folder


def test_resume_auto_takes_the_newest_complete_checkpoint_and_never_a_partial_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None and resolve_resume("auto", tmp_path) is None
    make_checkpoint(tmp_path / "checkpoint-2", 2)
    three = make_checkpoint(tmp_path / "checkpoint-3", 3)
    make_checkpoint(tmp_path / "checkpoint-4.partial", 4)  # killed after its last file, before the rename
    make_checkpoint(tmp_path / "checkpoint-5", None)  # no marker: not complete
    make_checkpoint(tmp_path / "checkpoint-6", 6, state=False)
    make_checkpoint(tmp_path / "final.old", 9)
    assert latest_checkpoint(tmp_path) == three == resolve_resume("auto", tmp_path)
    assert resolve_resume(str(three), tmp_path) == three and resolve_resume(None, tmp_path) is None
    with pytest.raises(UserError, match=r"resume='.*checkpoint-5' is not a complete checkpoint.*resume=auto"):
        resolve_resume(str(tmp_path / "checkpoint-5"), tmp_path)
    assert sorted(p.name for p in remove_partials(tmp_path)) == ["checkpoint-4.partial", "final.old"]
    final = make_checkpoint(tmp_path / "final", 3)
    assert latest_checkpoint(tmp_path) == three  # same step: the numbered one
    (final / MARKER_FILE).write_text(json.dumps({"step": 7}))
    assert latest_checkpoint(tmp_path) == final


def test_metrics_are_cut_back_to_the_resumed_step_including_a_line_cut_by_a_kill(tmp_path):
    file = tmp_path / "metrics.jsonl"
    file.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert truncate_metrics(file, 3) == 3
    assert [json.loads(line)["step"] for line in file.read_text().splitlines()] == [1, 2, 3]
    assert truncate_metrics(file, 3) == 0 and truncate_metrics(tmp_path / "none.jsonl", 1) == 0


def test_the_stream_resumes_without_replaying_a_prompt_of_the_epoch():
    rows = list(range(50))
    stream = PromptStream(rows, seed=4)
    seen = [stream.next_indices(8) for _ in range(3)]
    state = stream.state_dict()
    rest = [stream.next_indices(8) for _ in range(3)]
    resumed = PromptStream(rows, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    again = [resumed.next_indices(8) for _ in range(3)]
    assert again == rest
    flat = [i for batch in seen + again for i in batch]
    assert len(flat) == len(set(flat)) == 48  # one epoch of 50 rows: nothing drawn twice


def weights(folder):
    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def test_a_crash_inside_a_save_keeps_the_last_checkpoint_and_resume_auto_continues_exactly(tmp_path, monkeypatch):
    run(tmp_path / "full", "trainer.max_steps=4")
    assert sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]

    write = save._write_trainer_state

    class Killed(BaseException):  # like a kill, nothing catches it
        pass

    def crash_at_step_3(folder, state):
        if state["step"] == 3:
            raise Killed("killed while saving")  # the model is written, its trainer state is not
        write(folder, state)

    monkeypatch.setattr(save, "_write_trainer_state", crash_at_step_3)
    with pytest.raises(Killed):
        run(tmp_path / "cut", "trainer.max_steps=4")
    cut = tmp_path / "cut"
    assert {"checkpoint-1", "checkpoint-2", "checkpoint-3.partial"} <= {p.name for p in cut.iterdir()}
    assert latest_checkpoint(cut) == cut / "checkpoint-2"
    assert [json.loads(x)["step"] for x in (cut / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    monkeypatch.setattr(save, "_write_trainer_state", write)
    run(cut, "trainer.max_steps=4", "resume=auto")
    assert not list(cut.glob("*.partial"))
    lines = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [untimed(m) for m in lines] == [untimed(m) for m in full]
    assert sum(m["groups_used"] for m in lines[2:]) > 0  # the resumed steps did train
    before, after = weights(tmp_path / "full" / "final"), weights(cut / "final")
    assert all(torch.equal(before[k], after[k]) for k in before)
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["data"]["rows_seen"] == lines[-1]["rows_seen"] > 0


def test_resuming_from_an_earlier_checkpoint_removes_the_later_ones_of_that_run(tmp_path):
    run(tmp_path, "trainer.max_steps=3", "trainer.keep_checkpoints=0", "trainer.beta_th=0")
    make_checkpoint(tmp_path / "checkpoint-9.partial", 9)
    load = AutoModelForImageTextToText.from_pretrained
    one = load(tmp_path / "checkpoint-1").state_dict()
    run(tmp_path, "trainer.max_steps=2", f"resume={tmp_path / 'checkpoint-1'}", "trainer.beta_th=0")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((tmp_path / "final" / MARKER_FILE).read_text())["step"] == 2
    assert all(torch.equal(one[k], v) for k, v in load(tmp_path / "checkpoint-1").state_dict().items())


def test_checkpoints_hold_safetensors_weights_and_no_pickle(tmp_path):
    run(tmp_path, "trainer.max_steps=1", "trainer.beta_th=0")
    files = {p.name for p in (tmp_path / "checkpoint-1").iterdir()}
    assert "model.safetensors" in files and STATE_FILE in files and MARKER_FILE in files
    assert not [name for name in files if name.endswith((".bin", ".pkl", ".pth"))]
    state = torch.load(tmp_path / "checkpoint-1" / STATE_FILE, weights_only=True)
    assert set(state) == {"step", "optimizer", "scheduler", "data", "rng", "counters", "record"}
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"} and state["data"]["position"] > 0


def test_remote_code_runs_only_when_the_user_asks(monkeypatch, model_aliases):
    from transformers import AutoModelForImageTextToText as Model
    from transformers import AutoProcessor

    from gpg_vl.models.load import load_policy

    calls = []

    def record(original):
        def loader(*args, **kwargs):
            calls.append(kwargs.get("trust_remote_code"))
            return original(*args, **kwargs)
        return loader

    monkeypatch.setattr(AutoProcessor, "from_pretrained", record(AutoProcessor.from_pretrained))
    monkeypatch.setattr(Model, "from_pretrained", record(Model.from_pretrained))
    load_policy("embedded:tiny-qwen2.5-vl", dtype="float32")
    assert calls == [False, False]
    assert len(model_aliases) == len(list((ROOT / "configs" / "model").glob("[!_]*.yaml")))  # _tiny: shared
    for alias, model in model_aliases.items():
        assert model.trust_remote_code is False, alias


def load_script():
    spec = importlib.util.spec_from_file_location("check_resume", ROOT / "scripts" / "check_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights_and_metrics(tmp_path, monkeypatch):
    script = load_script()

    def forked_train(args: list[str], log: Path, prefix: list[str] | None = None, threads: int = 1):
        """check_resume's run of scripts/train.py, forked from a process that imported torch once (its SIGKILL
        ends a real process all the same): helpers/procs.py."""
        assert threads == 1
        return procs.Forked([*(prefix or []), str(ROOT / "scripts" / "train.py"), *args], output=log)

    monkeypatch.setattr(script, "_train", forked_train)
    result = script.check(tmp_path, steps=4, kill_after=2)  # killed while it writes checkpoint-3
    assert result["left_after_kill"].count("checkpoint-3.partial") == 1 and result["steps_logged_before_kill"] == [
        1, 2, 3]
    assert "checkpoint-2 at step 2" in result["resumed_from"]
    assert result["weights_identical"] and result["weights_trained"], result["sha256"]
    assert result["metrics_identical_after_kill"] and result["steps_once"] and not result["partials_left"]


RUN_SCRIPT = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')"


@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_to_the_uninterrupted_runs_adapters(tmp_path, monkeypatch):
    script = load_script()
    launches = []

    def forked_train(args: list[str], log: Path, prefix: list[str] | None = None, threads: int = 1):
        """check_resume's run of scripts/train.py, forked, each launch starting from another torch random state
        (as separate launches do; forks of one server would all start from the same)."""
        launches.append(args)
        code, extra = (prefix[1], prefix[2:]) if prefix else (RUN_SCRIPT, [])
        return procs.Forked(["-c", f"import torch\ntorch.manual_seed({len(launches)})\n{code}", *extra,
                             str(ROOT / "scripts" / "train.py"), *args], output=log)

    monkeypatch.setattr(script, "_train", forked_train)
    result = script.check(tmp_path, steps=3, kill_after=1, overrides=["model.lora.r=8"])  # dies writing checkpoint-2
    assert result["tensors"] > 0 and "checkpoint-1 at step 1" in result["resumed_from"]
    assert result["weights_identical"] and result["weights_trained"], result["sha256"]
    # step 1 of the killed run equals the uninterrupted run's: the two drew the same adapters
    assert result["metrics_identical_all"] and result["steps_once"] and not result["partials_left"]
