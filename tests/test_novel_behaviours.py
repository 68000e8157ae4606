"""bench/novel_behaviours.py (issue 26, part 3): each preference run on a behaviour's objective is set against SAC
trained on that objective as its reward, same seed and steps, and the ratio is read from the two runs' summaries."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


BENCH = [
    sys.executable, str(REPO / "bench/novel_behaviours.py"), "--behaviour", "hopper-backflip", "--seeds", "2",
    "--labels", "4", "--explore-steps", "200", "--feedback-frequency", "200", "--queries-per-session", "2",
    "--evaluation-frequency", "300",
]  # fmt: skip


def test_the_backflip_bench_runs_sac_on_the_objective_beside_each_preference_run(tmp_path):
    command = [*BENCH, "--steps", "600", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "backflip.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "backflip.json").read_text())
    [row] = report["rows"]
    runs = tmp_path / "work" / "runs"
    [preference_run] = [path for path in runs.iterdir() if not path.name.endswith("__sac")]
    ceiling_run = runs / f"{preference_run.name}__sac"
    ceiling_args = json.loads((ceiling_run / "args.json").read_text())
    assert ceiling_args["reward_objective"] == "hopper-backflip" and ceiling_args["seed"] == 2
    assert ceiling_args["total_timesteps"] == 600 and ceiling_args["terminate_when_unhealthy"] is False  # set by the objective
    ceiling = json.loads((ceiling_run / "summary.json").read_text())
    preference = json.loads((preference_run / "summary.json").read_text())
    assert row["ceiling_objective_return"] == ceiling["final_objective_return"]
    assert row["ceiling_objective_success"] == ceiling["final_objective_success"]
    assert row["objective_return"] == preference["final_objective_return"] and row["labels"] == 4
    assert row["return_ratio"] == pytest.approx(preference["final_objective_return"] / ceiling["final_objective_return"])
    assert "--explore-steps 200" in report["command"] and "--queries-per-session 2" in report["command"]

    # Another invocation reads that ceiling instead of running SAC again, with its own preference flags.
    again = [*BENCH, "--steps", "600", "--workdir", str(tmp_path / "again"), "--output", str(tmp_path / "again.json")]
    again += ["--ceiling-from", str(tmp_path / "work"), "--preference-flags=--no-surf --reward-ensemble-size 2"]
    result = subprocess.run(again, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [row] = json.loads((tmp_path / "again.json").read_text())["rows"]
    assert row["ceiling_run"] == ceiling_run.name and row["ceiling_objective_return"] == ceiling["final_objective_return"]
    [run] = (tmp_path / "again" / "runs").iterdir()  # no SAC run of its own
    run_args = json.loads((run / "args.json").read_text())
    assert run_args["surf"] is False and run_args["reward_ensemble_size"] == 2

    # Ceilings of other settings are refused before anything runs: the same seed and objective, but 600 steps, not 900.
    other = [*BENCH, "--steps", "900", "--workdir", str(tmp_path / "other"), "--output", str(tmp_path / "other.json")]
    result = subprocess.run([*other, "--ceiling-from", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "no SAC run there with" in result.stderr and "'total_timesteps': 900" in result.stderr
    assert not (tmp_path / "other").exists()
