"""scripts/compare.py --quick: the machinery of the GPG vs GRPO-family comparison (a tiny budget, 2 seeds)."""

import json
import sys
from pathlib import Path

import pytest
from helpers import procs

ROOT = Path(__file__).resolve().parents[2]


# 8 runs on the one worker process --quick reuses (a fresh process per run would add a torch import to each)
def test_quick_comparison_writes_tables_curves_claims_and_spends_equal_budgets(tmp_path):
    done = procs.run(["scripts/compare.py", "--quick", "--workers", "1", "--out", str(tmp_path)],
                     timeout=600)  # forked: helpers/procs.py
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "compare.json").read_text())
    settings = report["settings"]
    assert set(report["cells"]) == {"gpg", "grpo", "dr_grpo", "dapo"}
    assert len(report["runs"]) == 4 * len(settings["seeds"])
    for run in report["runs"]:
        assert run["completions_sampled"] == settings["budget"]  # the same budget for every algorithm
        assert f"algorithm={run['variant']}" in run["overrides"]
        assert run["wall_seconds"] > 0 and run["seconds_per_step"] > 0
        assert run["peak_mib"] > 0  # the run loads a model and steps inside the meter: memory above its start
    for variant, cell in report["cells"].items():  # each run evaluated eval_limit rows: its accuracy is k / limit
        accuracy = [r["accuracy_after"] for r in report["runs"] if r["variant"] == variant]
        assert all((a * settings["eval_limit"]).is_integer() for a in accuracy)
        assert cell["accuracy_mean"] == pytest.approx(sum(accuracy) / len(accuracy))
    assert [p["variant"] for p in report["paired_vs_gpg"]] == ["grpo", "dr_grpo", "dapo"]
    assert [c["claim"] for c in report["claims"]] == ["GPG ≥ GRPO at equal samples", "GPG ≥ Dr. GRPO / DAPO",
                                                       "GPG is cheaper per step (time and memory)"]
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {a} |" in table for a in report["cells"]) and "supported" in table
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_a_budget_of_sampled_tokens_stops_each_run_on_it_and_is_reported(tmp_path):
    """--budget-tokens N: trainer.max_sampled_tokens=N instead of max_completions (max_steps only bounds the run),
    one real run in this process, stopped at the first step that reached N; the table reports the tokens."""
    from gpg_vl.experiments import run_cell

    sys.path.insert(0, str(ROOT / "scripts"))
    import compare

    args = compare.parse_args(["--quick", "--budget-tokens", "20", "--algorithms", "gpg", "--seeds", "0"])
    overrides = compare.run_overrides("gpg", 0, args, tmp_path / "run")
    assert "trainer.max_sampled_tokens=20" in overrides and "trainer.max_steps=5" in overrides  # 20 / (B 2 x G 2)
    assert not any(o.startswith("trainer.max_completions") for o in overrides)
    run = run_cell("gpg", args.group_size, 0, overrides)  # gpg_vl/experiments.py, as the script's workers
    tokens = [point["tokens"] for point in run["curve"]]
    assert run["tokens_sampled"] == tokens[-1] >= 20 and all(t < 20 for t in tokens[:-1])
    run.update(peak_mib=1.0, seconds_per_step=1.0)  # what run_measured adds around run_cell
    cells, _, _, table = compare.summarise([run], args)
    assert "20 sampled tokens per run" in table and cells["gpg"]["tokens_sampled"] == run["tokens_sampled"]
    assert table.splitlines()[4].endswith(f"| {run['completions_sampled']} | {run['tokens_sampled']} |")
    with pytest.raises(SystemExit):
        compare.parse_args(["--budget", "64", "--budget-tokens", "100"])  # one budget or the other
