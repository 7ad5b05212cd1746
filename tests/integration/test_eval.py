"""scripts/eval.py and the docs' example task, on the tiny model."""

import json
import re
from pathlib import Path

import pytest

from gpg_vl.cli import eval_main, train_main
from gpg_vl.config.compose import load_config, run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_eval_writes_predictions_and_metrics_and_rescoring_needs_no_model(tmp_path, monkeypatch):
    metrics = eval_main(load_config("eval", [f"output_dir={tmp_path / 'a'}", "eval.limit=12", "eval.batch_size=5"]))
    records = [json.loads(x) for x in (tmp_path / "a" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 12
    assert {"id", "prompt", "completion", "answer", "target", "rewards"} <= set(records[0])
    assert json.loads((tmp_path / "a" / "metrics.json").read_text()) == metrics
    assert metrics["accuracy"] == sum(r["rewards"]["accuracy"] for r in records) / 12

    import gpg_vl.train.build

    def no_model(*args, **kwargs):
        raise AssertionError("re-scoring must not load a model")

    monkeypatch.setattr(gpg_vl.train.build, "build_policy", no_model)
    rescored = eval_main(load_config("eval", [f"output_dir={tmp_path / 'b'}",
                                              f"predictions={tmp_path / 'a' / 'predictions.jsonl'}"]))
    assert rescored == metrics


def test_rescoring_a_file_from_another_split_fails_in_one_sentence(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"index": 0, "id": "elsewhere-0", "split": "test", "completion": "x"}) + "\n")
    assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path}"]) == 2
    assert "does not match" in capsys.readouterr().err



@pytest.mark.parametrize(("line", "says"), [
    ({"index": 0, "id": "0"}, "has no completion"),
    ({"id": "0", "completion": "x"}, "has no index"),
    ({"index": "zero", "id": "0", "completion": "x"}, "has index 'zero'"),
    ({"index": float("nan"), "id": "0", "completion": "x"}, "has index nan"),
    ({"index": -1, "id": "0", "completion": "x"}, "has index -1"),
    ({"index": 0, "id": "0", "completion": 3}, "completion of type int"),
    ([0, "x"], "holds a JSON list"),
])
def test_rescoring_a_malformed_predictions_line_fails_in_one_sentence(tmp_path, capsys, line, says):
    bad = tmp_path / "p.jsonl"
    good = {"index": 1, "id": "1", "completion": "<answer>x</answer>"}
    bad.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: line 2 of predictions file") and says in err and err.count("\n") == 1


def test_rescoring_names_the_files_line_that_is_not_json_and_refuses_an_empty_file(tmp_path, capsys):
    good = [json.dumps({"index": i, "id": str(i), "completion": "<answer>x</answer>"}) for i in range(11)]
    bad = tmp_path / "p.jsonl"
    bad.write_text("\n".join([*good, '{"index": 11, "id": "11", "completion": }']) + "\n")
    assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: line 12 of predictions file {str(bad)!r} is not JSON (Expecting value at column 41); "
                   "pass a predictions.jsonl written by scripts/eval.py.\n")
    for text in ("", "\n \n"):
        bad.write_text(text)
        assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path / 'empty'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: predictions file {str(bad)!r} holds no records") and err.count("\n") == 1
        assert not (tmp_path / "empty" / "metrics.json").exists()

def test_rescoring_a_file_with_a_line_written_twice_names_the_repeated_record(tmp_path, capsys):
    """Every line twice read as "does not number its samples 0 to 1" (issue 59)."""
    lines = [json.dumps({"index": i, "id": str(i), "completion": "<answer>x</answer>"}) for i in range(3)]
    bad = tmp_path / "p.jsonl"
    for text, record in (("\n".join(lines + lines), "row index 0's sample 0 2 times"),
                         ("\n".join(lines + lines[1:2]), "row index 1's sample 0 2 times")):
        bad.write_text(text + "\n")
        assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path / 'out'}"]) == 2
        assert capsys.readouterr().err == (f"error: the predictions file {str(bad)!r} holds {record} (a line written "
                                           "twice?); re-score a file written by scripts/eval.py, each line once.\n")


def test_a_mixture_is_evaluated_task_by_task_as_training_evaluates_it(tmp_path, capsys):
    """scripts/eval.py task=mix ended in NotImplementedError (issue 59): each task on its own split, with its own
    settings, into <output_dir>/<task>/, and `accuracy` the mean of the tasks' accuracies, as training's held-out
    evaluation reports a mixture."""
    mixed = eval_main(load_config("eval", ["task=mix", "task.mixture={shapes: 1, motion: 1}", "model=tiny",
                                           "eval.limit=4", f"output_dir={tmp_path / 'mix'}"]))
    alone = eval_main(load_config("eval", ["task=shapes", "model=tiny", "eval.limit=4",
                                           f"output_dir={tmp_path / 'shapes'}"]))
    assert {key[len("shapes/"):]: value for key, value in mixed.items() if key.startswith("shapes/")} == alone
    assert mixed["accuracy"] == (mixed["shapes/accuracy"] + mixed["motion/accuracy"]) / 2
    assert json.loads((tmp_path / "mix" / "metrics.json").read_text()) == mixed
    for name in ("shapes", "motion"):
        records = (tmp_path / "mix" / name / "predictions.jsonl").read_text().splitlines()
        assert len(records) == 4 and (tmp_path / "mix" / name / "predictions.html").is_file()
    assert (tmp_path / "mix" / "shapes" / "predictions.jsonl").read_text() == \
        (tmp_path / "shapes" / "predictions.jsonl").read_text()
    out = capsys.readouterr().out
    assert "shapes / test: 4 rows" in out and "motion / " in out
    code = run_cli("eval", eval_main, ["task=mix", "task.mixture={shapes: 1, motion: 1}",
                                       f"predictions={tmp_path / 'shapes' / 'predictions.jsonl'}",
                                       f"output_dir={tmp_path / 'again'}"])
    assert code == 2 and capsys.readouterr().err == (
        "error: predictions= re-scores one task's predictions, and task=mix evaluates several; re-score each task's "
        "file with that task (task=<entry> predictions=<output_dir>/<entry>/predictions.jsonl, where a mixture's "
        "evaluation writes them).\n")


def test_the_docs_example_task_registers_and_trains_two_steps(tmp_path):
    page = (ROOT / "docs" / "adding-a-task.md").read_text()
    code = re.search(r"```python\n# dominant.py\n(.*?)```", page, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) <= 40
    plugin = tmp_path / "dominant.py"
    plugin.write_text(code)
    summary = train_main(load_config("train", [f"task={plugin}:Dominant", f"output_dir={tmp_path / 'run'}",
                                               "trainer.max_steps=2", "trainer.batch_size=4",
                                               "trainer.group_size=4", "rollout.max_new_tokens=12",
                                               "eval.limit=8", "trainer.lr=1e-5", "trainer.max_attempts=2"]))
    assert summary["task"] == "dominant" and summary["steps"] == 2
    # measured: two steps at lr 1e-5 teach the tiny model no answer within 12 tokens
    assert summary["accuracy_after"] == 0.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "reward/accuracy" in json.loads(lines[0])
