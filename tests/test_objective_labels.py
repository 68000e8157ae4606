"""bench/objective_labels.py: what the labels of a run taught by a --teacher-objective compared, per window of steps."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bench import bench_module
from test_custom_env import WINDMILL, tiny

import sac_rlhf
from cleanrlhf_utils.feedback import read_label_file
from cleanrlhf_utils.objectives import OBJECTIVES, step_rewards


@pytest.fixture(scope="module")
def objective_labels():
    return bench_module("objective_labels")


def test_a_window_counts_the_pairs_a_fall_decides_and_the_contrast_of_the_rest(objective_labels):
    """Three pairs of 4-step segments: one whose second segment ends after 2 steps, two of equal length whose mean
    rewards a step differ by 0.1 and by 0.3."""
    masks = np.ones((3, 2, 4), dtype=bool)
    masks[0, 1, 2:] = False
    rewards = np.array(
        [
            [[0.4, 0.4, 0.4, 0.4], [0.6, 0.6, 0.0, 0.0]],
            [[0.5, 0.5, 0.5, 0.5], [0.6, 0.6, 0.6, 0.6]],
            [[0.2, 0.2, 0.2, 0.2], [0.5, 0.5, 0.5, 0.5]],
        ]
    )
    row = objective_labels.window_row("run", "0k–20k", rewards, masks, reward_above=0.45)
    assert row["pairs"] == 3 and row["one_ends"] == pytest.approx(1 / 3)
    assert row["objective_per_step"] == pytest.approx(rewards.sum() / 22)  # 22 real steps, the masked ones left out
    assert row["above"] == pytest.approx(14 / 22)  # 0.6 twice, 0.5 and 0.6 four times each, 0.5 four times
    assert row["d_per_step"] == pytest.approx(0.2)  # the median of 0.1 and 0.3; the pair a fall decided is left out
    none_equal = objective_labels.window_row("run", "all", rewards[:1], masks[:1], reward_above=0.0)
    assert none_equal["one_ends"] == 1.0 and none_equal["d_per_step"] is None


def test_a_runs_windows_hold_each_label_once_and_measure_the_objective_of_its_steps(objective_labels, chdir_tmp):
    """A real windmill run taught by windmill-clockwise: its labels split by when they came, and the objective's
    reward of every real step of the labelled segments, each taken alone, gives the pooled figures."""
    args = tiny(
        sac_rlhf, run_name="mill", teacher_objective="windmill-clockwise", total_timesteps=700, learning_starts=200,
        total_explore_steps=300, teacher_feedback_frequency=200, teacher_feedback_total_queries=30, batch_size=32,
        actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32, teacher_feedback_schedule="linear",
    )  # fmt: skip
    sac_rlhf.main(args)
    rows = objective_labels.run_rows(Path("."), "mill", "windmill", window=400, reward_above=0.0)
    windows, pooled = rows[:-1], rows[-1]
    assert [row["window"] for row in windows] == ["0–400", "400–800"]  # sessions at 300 and 500 steps
    segments, _ = read_label_file("runs/mill/labels.sqlite")
    assert pooled["window"] == "all" and pooled["pairs"] == len(segments["masks"]) == sum(row["pairs"] for row in windows)
    masks = segments["masks"].astype(bool)
    obs_dim = segments["obs_actions"].shape[-1] - 1  # the windmill's one action
    steps = segments["obs_actions"][masks]
    each = step_rewards(OBJECTIVES["windmill-clockwise"], steps[:, :obs_dim], steps[:, obs_dim:], segments["physics_states"][masks])
    assert pooled["objective_per_step"] == pytest.approx(each.mean(), rel=1e-6)
    assert pooled["above"] == pytest.approx((each > 0).mean())
    assert pooled["one_ends"] == 0.0  # the windmill's episodes all run to the time limit


def test_a_run_without_an_objective_is_refused_in_one_line_and_nothing_is_written(objective_labels, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "plain"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"env_id": WINDMILL, "teacher_objective": None}))
    (run / "labels.sqlite").write_bytes(b"")
    output = tmp_path / "x.json"
    common = ["objective_labels.py", "--workdir", str(tmp_path), "--runs", "plain", "--output", str(output)]
    monkeypatch.setattr(sys, "argv", common)
    with pytest.raises(SystemExit, match="--runs plain was taught by its env's reward, not a --teacher-objective"):
        objective_labels.main()
    monkeypatch.setattr(sys, "argv", [*common, "--window", "0"])
    with pytest.raises(SystemExit, match="--window 0: steps per window must be > 0"):
        objective_labels.main()
    assert not output.exists()
