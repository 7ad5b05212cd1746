"""scripts/compare.py --quick: the machinery of the GPG vs GRPO-family comparison (a tiny budget, 2 seeds)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# 8 runs, each in a fresh process (81 s on 2 idle cores): marked slow like ablate.py's quick grid, so that under
# pytest-xdist it starts first (tests/conftest.py)
@pytest.mark.slow
def test_quick_comparison_writes_tables_curves_claims_and_spends_equal_budgets(tmp_path):
    done = subprocess.run([sys.executable, "scripts/compare.py", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
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
        assert 0.0 <= run["accuracy_after"] <= 1.0
    assert [p["variant"] for p in report["paired_vs_gpg"]] == ["grpo", "dr_grpo", "dapo"]
    assert [c["claim"] for c in report["claims"]] == ["GPG ≥ GRPO at equal samples", "GPG ≥ Dr. GRPO / DAPO",
                                                       "GPG is cheaper per step (time and memory)"]
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {a} |" in table for a in report["cells"]) and "supported" in table
    assert (tmp_path / "compare.png").stat().st_size > 10_000
