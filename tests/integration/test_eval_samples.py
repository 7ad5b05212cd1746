"""Evaluation over k samples per row (eval.samples, eval.temperature): through scripts/eval.py's entry point, in
training, multi-turn and on video; every sample in predictions.jsonl, and re-scoring from it."""

import json

import pytest

from gpg_vl.cli import eval_main, train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.train.eval.at_k import pass_at_k

SAMPLED = ["eval.limit=6", "eval.samples=4", "eval.temperature=1.0", "eval.max_new_tokens=16"]


def records_of(folder):
    return [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]


def test_k_samples_are_saved_scored_by_hand_and_rescored_alike(tmp_path, monkeypatch):
    metrics = eval_main(load_config("eval", [f"output_dir={tmp_path / 'a'}", *SAMPLED]))
    records = records_of(tmp_path / "a")
    assert [(r["index"], r["sample"]) for r in records] == [(i, j) for i in range(6) for j in range(4)]
    # by hand from the records: mean@4, pass@k, maj@4 (the first of the most frequent answers)
    rows = [[r for r in records if r["index"] == i] for i in range(6)]
    right = [[r["rewards"]["accuracy"] for r in row] for row in rows]
    assert metrics["accuracy"] == pytest.approx(metrics["mean@4"])
    assert metrics["mean@4"] == pytest.approx(sum(map(sum, right)) / 24)
    for k in (1, 2, 4):
        assert metrics[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, int(sum(s)), k) for s in right) / 6)
    majority = []
    for row in rows:
        answers = [r["answer"] for r in row if r["answer"] is not None]
        winner = max(answers, key=lambda a: (answers.count(a), -answers.index(a))) if answers else None
        majority.append(0.0 if winner is None else next(r for r in row if r["answer"] == winner)["rewards"]["accuracy"])
    assert metrics["maj@4"] == pytest.approx(sum(majority) / 6)
    assert {"mean@4_stderr", "pass@4_stderr", "maj@4_stderr"} <= set(metrics)
    categories = {r["question_type"] for r in rows_of_task(6)}
    assert all(f"mean@4/{c}" in metrics and f"maj@4/{c}" in metrics for c in categories)
    # the same seed draws the same samples
    again = eval_main(load_config("eval", [f"output_dir={tmp_path / 'b'}", *SAMPLED]))
    assert again == metrics
    assert [r["completion"] for r in records_of(tmp_path / "b")] == [r["completion"] for r in records]

    import gpg_vl.train.build

    monkeypatch.setattr(gpg_vl.train.build, "build_policy", lambda *a, **k: pytest.fail("re-scoring loads no model"))
    rescored = eval_main(load_config("eval", [f"output_dir={tmp_path / 'c'}",
                                              f"predictions={tmp_path / 'a' / 'predictions.jsonl'}"]))
    assert rescored == metrics  # the answers' entropy too, from the (sum, count) each record saved


def rows_of_task(limit):
    from gpg_vl.data.task import get_task

    return list(get_task("shapes").load("test"))[:limit]


def test_greedy_stays_the_default_and_its_records_unchanged(tmp_path):
    metrics = eval_main(load_config("eval", [f"output_dir={tmp_path}", "eval.limit=4", "eval.max_new_tokens=16"]))
    assert not any("@" in name for name in metrics) and "sample" not in records_of(tmp_path)[0]
    explicit = eval_main(load_config("eval", [f"output_dir={tmp_path / 'b'}", "eval.limit=4", "eval.max_new_tokens=16",
                                              "eval.samples=1", "eval.temperature=0"]))
    assert explicit == metrics


def test_an_incomplete_k_sample_file_and_greedy_k_samples_fail_in_one_sentence(tmp_path, capsys):
    records = [{"index": i, "id": str(i), "sample": j, "completion": "<answer>red</answer>"}
               for i in range(2) for j in range(3)][:-1]
    bad = tmp_path / "p.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_cli("eval", eval_main, [f"predictions={bad}", f"output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err
    assert "holds 3 samples for some rows but 2 for row index 1" in err and err.count("\n") == 1
    assert run_cli("eval", eval_main, ["eval.samples=4", "eval.temperature=0", f"output_dir={tmp_path / 'g'}"]) == 2
    assert "decodes 4 identical completions" in capsys.readouterr().err


def test_k_samples_in_training_leave_the_training_draws_as_they_were(tmp_path):
    common = ["task=shapes", "model=tiny", "trainer.max_steps=1", "trainer.batch_size=2", "trainer.group_size=2",
              "rollout.max_new_tokens=8", "eval.limit=3", "eval.max_new_tokens=8", "trainer.eval_after=false",
              "trainer.save_every=0"]
    summary = train_main(load_config("train", [*common, "trainer.eval_before=true", "eval.samples=3",
                                               "eval.temperature=1.0", f"output_dir={tmp_path / 'k'}"]))
    assert {"mean@3", "pass@3", "maj@3", "mean@3_stderr"} <= set(summary["eval_before"])
    plain = train_main(load_config("train", [*common, "trainer.eval_before=false", f"output_dir={tmp_path / 'p'}"]))
    assert plain["steps"] == summary["steps"] == 1
    first = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]) for name in ("k", "p")]
    assert first[0]["loss"] == first[1]["loss"] and first[0]["reward_mean"] == first[1]["reward_mean"]


def test_k_samples_multi_turn_and_on_video(tmp_path):
    zoom = eval_main(load_config("eval", [
        "task=zoom", "model.name_or_path=embedded:tiny-qwen2.5-vl-zoom", "model.max_pixels=12544",
        "rollout.max_turns=2", "eval.limit=3", "eval.samples=2", "eval.temperature=1.0", "eval.max_new_tokens=16",
        f"output_dir={tmp_path / 'zoom'}"]))
    records = records_of(tmp_path / "zoom")
    assert len(records) == 6 and all("turns" in r for r in records) and {"mean@2", "turns_mean"} <= set(zoom)
    motion = eval_main(load_config("eval", ["task=motion", "eval.limit=3", "eval.samples=2", "eval.temperature=1.0",
                                            "eval.max_new_tokens=8", f"output_dir={tmp_path / 'motion'}"]))
    assert len(records_of(tmp_path / "motion")) == 6 and {"mean@2", "pass@2", "maj@2"} <= set(motion)
