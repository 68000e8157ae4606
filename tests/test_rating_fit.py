"""bench/rating_fit.py: a rating run's labels fitted as ratings and as the pairs they imply, measured on later sessions."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
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
    """A real windmill run rating pairs of clips on a scale of 5 by windmill-clockwise, four sessions of 25: the fits
    learn from the first two sessions' queries (the pairs fit from the pairs they imply, the session fit with a set of
    cut points per session) with the run's reward training (up to 150 epochs) and place the next sessions' clips'
    returns as the objective does; the teacher's ratings are one scale within each session."""
    args = tiny(
        sac_rlhf, run_name="mill", teacher_objective="windmill-clockwise", rating_scale=5, total_timesteps=500,
        learning_starts=100, total_explore_steps=100, teacher_feedback_frequency=100, teacher_feedback_total_queries=100,
        teacher_feedback_schedule="linear", batch_size=32, actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32,
        reward_net_epochs=150, teacher_feedback_num_queries_per_session=25,
    )  # fmt: skip
    sac_rlhf.main(args)
    fits = ("pairs", "ratings", "ratings_session_cuts")
    rows = {fit: rating_fit.fit_row(Path("."), "mill", fit, 2, 2, seed=0, cut_lr=0.03) for fit in fits}
    sessions = rating_fit.label_column(Path("runs/mill/labels.sqlite"), "session")
    assert rows["ratings"]["train_queries"] == rows["pairs"]["train_queries"] == (sessions <= 2).sum() > 40
    for row in rows.values():  # the later clips of one spinning policy differ little: their returns, not their pairs
        assert row["segment_correlation"] > 0.5 and 0 <= row["pair_accuracy"] <= 1, row
    assert rows["ratings_session_cuts"]["train_accuracy"] >= 0.97 or rows["ratings_session_cuts"]["epochs"] == 150
    again = rating_fit.fit_row(Path("."), "mill", "ratings_session_cuts", 2, 2, seed=0, cut_lr=0.03)
    assert again == rows["ratings_session_cuts"]  # same seed, same numbers
    shares = rating_fit.scale_shares(rating_fit.read_run(Path("."), "mill"), "mill", 2)
    assert 0 < shares["one_scale"] <= shares["session_scales"] == 1.0  # a noiseless teacher is one scale per session
    with pytest.raises(SystemExit, match="--runs mill has 4 sessions of labels; --train-sessions 3 and --test-sessions 2 need 5"):
        rating_fit.fit_row(Path("."), "mill", "ratings", 3, 2, seed=0, cut_lr=0.03)


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


def test_the_share_one_scale_rates_right_is_the_longest_run_of_ratings_that_never_goes_down(rating_fit):
    returns = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 6.0])
    assert rating_fit.one_scale_share(returns, np.array([2, 0, 1, 1, 2, 3]), 4) == 1.0  # one increasing map rates all
    # In return order the ratings read 0 2 1 0 3 1: the longest run never going down is 0 2 3 or 0 1 1 (and so on): 3.
    assert rating_fit.one_scale_share(returns, np.array([3, 0, 1, 2, 0, 1]), 4) == 0.5


def test_each_sessions_cut_points_follow_a_teacher_whose_scale_moved_between_sessions(rating_fit):
    """Clips whose reward is their first feature, rated on a scale of 5 in two sessions: the second anchors its scale
    on better clips, so the same return rates lower there. Fitted with a set of cut points per session until the
    returns order every rated pair, the second session's cuts lie above the first's, the lowest by most, as the bins
    moved (by 2 at the bottom, 1 on average, 0 at the top)."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    queries, length, scale = 120, 5, 5
    steps = rng.normal(size=(queries, 2, length, 3)).astype(np.float32)
    returns = steps[..., 0].sum(-1)
    session = np.repeat([0, 1], queries // 2)
    low = np.where(session == 1, returns.min() + 2.0, returns.min())[:, None]  # the second session's scale starts higher
    ratings = np.clip(((returns - low) / (returns.max() - low) * scale).astype(int), 0, scale - 1)
    segments = {"obs_actions": steps, "masks": np.ones((queries, 2, length), np.float32)}
    args = sac_rlhf.Args(segment_length=length, rating_scale=scale, surf=False, reward_net_hidden_dim=32, reward_net_epochs=100)
    args = replace(args, reward_net_batch_size=16, reward_net_lr=1e-3, reward_net_target_accuracy=1.0)
    model = sac_rlhf.RewardEnsemble.from_args(3, args)
    stats = rating_fit.fit_scales(model, args, segments, rating_labels(ratings, scale), session, cut_lr=0.03, seed=0)
    assert stats["train_accuracy"] == rating_fit.ordered_pair_accuracy(model, segments, rating_labels(ratings, scale), scale)
    assert stats["train_accuracy"] > 0.9, stats
    learned = sac_rlhf.segment_returns(model, torch.as_tensor(steps), torch.as_tensor(segments["masks"])).mean(0).numpy()
    slope = np.polyfit(returns.ravel(), learned.ravel(), 1)[0]  # the model's returns per return of the true reward
    moved = (stats["cuts"][:, 1] - stats["cuts"][:, 0]).mean(0).numpy() / slope  # in the true reward's returns
    assert 0.5 < moved.mean() < 1.5 and moved[0] > moved[-1], moved  # the anchor moved 2; the top of the scale stayed
    # One increasing map of the return cannot give every clip its rating; one per session can.
    assert rating_fit.one_scale_share(returns.ravel(), ratings.ravel(), scale) < 0.9
    for part in (session == 0, session == 1):
        assert rating_fit.one_scale_share(returns[part].ravel(), ratings[part].ravel(), scale) == 1.0
