"""bench/rating_fit.py: a rating run's labels fitted as ratings and as the pairs they imply, measured on later sessions."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bench import bench_module
from test_custom_env import WINDMILL, tiny

import sac_rlhf
from cleanrlhf_utils.ratings import rating_labels


@pytest.fixture(scope="module")
def rating_fit():
    return bench_module("rating_fit")


def test_the_pairs_of_a_rated_query_keep_each_clip_with_its_rating(rating_fit):
    """Two queries of three clips, each clip's steps marked with its query and place: the pairs come out in
    clip_pairs order, each pair's segments the clips it names, labelled 1 where the second is rated higher, 0 lower and
    0.5 the same."""
    marks = np.array([[0, 1, 2], [10, 11, 12]], dtype=np.float32)  # query q, clip c: 10 q + c
    segments = {"obs_actions": np.broadcast_to(marks[:, :, None, None], (2, 3, 4, 1)).copy(), "masks": np.ones((2, 3, 4))}
    labels = rating_labels(np.array([[0, 2, 1], [3, 3, 0]]), 4)  # ratings less one on a scale of 4
    pairs, pair_labels = rating_fit.as_pairs(segments, labels, clips=3, scale=4)
    assert pairs["obs_actions"].shape == (6, 2, 4, 1) and pairs["masks"].shape == (6, 2, 4)
    np.testing.assert_array_equal(pairs["obs_actions"][:, :, 0, 0], [[0, 1], [0, 2], [1, 2], [10, 11], [10, 12], [11, 12]])
    np.testing.assert_array_equal(pair_labels, [1, 1, 0, 0.5, 0, 0])


def test_a_span_gap_spreads_the_cut_points_over_the_middle_half_of_the_returns(rating_fit):
    model = sac_rlhf.RewardEnsemble(3, 2, 8, 1, rating_scale=6)
    rating_fit.start_cuts(model, rating_fit.fit_gap("ratings_gap_span", segment_length=40, scale=6))
    np.testing.assert_allclose(model.rating_cuts().detach().numpy(), [[-20, -10, 0, 10, 20]] * 2, atol=1e-5)
    assert rating_fit.fit_gap("ratings", 40, 6) == 1.0 and rating_fit.fit_gap("pairs", 40, 6) is None


def test_a_rating_runs_first_sessions_are_fitted_and_measured_on_the_next(rating_fit, chdir_tmp):
    """A real windmill run rating pairs of clips on a scale of 5 by windmill-clockwise, four sessions of 25: both fits
    learn from the first two sessions' queries (the pairs fit from the pairs they imply) with the run's reward
    training (up to 150 epochs) and place the next sessions' clips' returns as the objective does."""
    args = tiny(
        sac_rlhf, run_name="mill", teacher_objective="windmill-clockwise", rating_scale=5, total_timesteps=500,
        learning_starts=100, total_explore_steps=100, teacher_feedback_frequency=100, teacher_feedback_total_queries=100,
        teacher_feedback_schedule="linear", batch_size=32, actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32,
        reward_net_epochs=150, teacher_feedback_num_queries_per_session=25,
    )  # fmt: skip
    sac_rlhf.main(args)
    rows = {fit: rating_fit.fit_row(Path("."), "mill", fit, 2, 2, seed=0) for fit in ("pairs", "ratings")}
    sessions = rating_fit.label_column(Path("runs/mill/labels.sqlite"), "session")
    assert rows["ratings"]["train_queries"] == rows["pairs"]["train_queries"] == (sessions <= 2).sum() > 40
    for row in rows.values():  # the later clips of one spinning policy differ little: their returns, not their pairs
        assert row["segment_correlation"] > 0.5 and 0 <= row["pair_accuracy"] <= 1, row
    assert rows["ratings"] == rating_fit.fit_row(Path("."), "mill", "ratings", 2, 2, seed=0)  # same seed, same numbers
    with pytest.raises(SystemExit, match="--runs mill has 4 sessions of labels; --train-sessions 3 and --test-sessions 2 need 5"):
        rating_fit.fit_row(Path("."), "mill", "ratings", 3, 2, seed=0)


def test_a_run_without_ratings_is_refused_in_one_line_and_nothing_is_written(rating_fit, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "pairs"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"env_id": WINDMILL, "teacher_objective": "windmill-clockwise", "rating_scale": 0}))
    (run / "labels.sqlite").write_bytes(b"")
    output = tmp_path / "x.json"
    common = ["rating_fit.py", "--workdir", str(tmp_path), "--runs", "pairs", "--output", str(output)]
    monkeypatch.setattr(sys, "argv", common)
    with pytest.raises(SystemExit, match="--runs pairs compared or ranked its clips"):
        rating_fit.main()
    monkeypatch.setattr(sys, "argv", [*common, "--cut-gaps", "-2"])
    with pytest.raises(SystemExit, match="--cut-gaps -2: a gap is a return > 0, or span"):
        rating_fit.main()
    assert not output.exists()
