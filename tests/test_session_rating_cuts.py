"""bench/session_rating_cuts.py: PEBBLE reading each feedback session's ratings on that session's own scale."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_bench import bench_module
from test_custom_env import tiny
from test_end_to_end import assert_same_training, final_state

import sac_rlhf
from cleanrlhf_utils.ratings import rating_labels


@pytest.fixture(scope="module")
def session_cuts():
    return bench_module("session_rating_cuts")


@pytest.fixture
def patched_accuracy(monkeypatch):
    """main points sac_rlhf's rating accuracy at the run's own cut points: put back after the test."""
    monkeypatch.setattr(sac_rlhf, "rating_accuracy", sac_rlhf.rating_accuracy)


def moving_scale_labels(session_cuts, first_step: int, frequency: int):
    """Clips whose reward is their first feature, rated on a scale of 5 in two sessions (at `first_step` and one
    `frequency` later) by a teacher whose second session anchors its scale 2 returns higher, so the same return rates
    lower there. Returns (the preference buffer, the true returns (N, 2), the ratings, the settings)."""
    rng = np.random.default_rng(0)
    queries, length, scale = 120, 5, 5
    steps = rng.normal(size=(queries, 2, length, 3)).astype(np.float32)
    returns = steps[..., 0].sum(-1)
    second = np.repeat([False, True], queries // 2)
    low = np.where(second, returns.min() + 2.0, returns.min())[:, None]
    ratings = np.clip(((returns - low) / (returns.max() - low) * scale).astype(int), 0, scale - 1)
    args = session_cuts.Args(
        segment_length=length, rating_scale=scale, surf=False, reward_net_hidden_dim=32, reward_net_epochs=100,
        learning_starts=first_step, total_explore_steps=first_step, teacher_feedback_frequency=frequency,
        teacher_feedback_total_queries=queries, teacher_feedback_num_queries_per_session=queries // 2,
    )  # fmt: skip
    args = replace(args, reward_net_batch_size=16, reward_net_lr=1e-3, reward_net_target_accuracy=1.0)
    prefs = sac_rlhf.PreferenceBuffer(length, 3, 1)
    for part, step in ((~second, first_step), (second, first_step + frequency)):
        n = int(part.sum())
        prefs.add(
            steps[part], np.ones((n, 2, length), bool), np.zeros((n, 2, length)), np.zeros((n, 2, length, 1)),
            rating_labels(ratings[part], scale), np.zeros(n, bool), step,
        )  # fmt: skip
    return prefs, returns, ratings, args


def test_a_label_belongs_to_the_last_session_due_at_the_step_it_was_obtained(session_cuts):
    """Four sessions from step 100 (the end of exploration), one every 100 steps: a label obtained at the step its
    session is due, or later while it is the last one due, is that session's; steps past the last session stay in it."""
    args = session_cuts.Args(
        total_explore_steps=100, teacher_feedback_frequency=100, teacher_feedback_total_queries=40,
        teacher_feedback_num_queries_per_session=10, teacher_feedback_schedule="linear", rating_scale=5,
    )  # fmt: skip
    training = session_cuts.SessionRatingCuts(args)
    prefs = sac_rlhf.PreferenceBuffer(2, 1, 1)
    prefs.global_steps = np.array([100, 100, 199, 200, 399, 400, 1000])
    np.testing.assert_array_equal(training.sessions(prefs, np.arange(7)), [0, 0, 0, 1, 2, 3, 3])
    assert training.cut_parameters.shape == (args.reward_ensemble_size, 4, 4)


def test_each_sessions_cut_points_follow_a_teacher_whose_scale_moved(session_cuts, patched_accuracy):
    """The run's reward training on a teacher whose second session rates the same return lower: it trains until the
    returns order the rated pairs, the second session's cuts lie above the first's, the lowest by most (the scale's
    bottom moved 2 returns, its top not at all), and each clip read against its own session's cuts gets its exact rating
    more often than with either session's cuts for all."""
    torch.manual_seed(0)
    prefs, returns, ratings, args = moving_scale_labels(session_cuts, first_step=1000, frequency=500)
    training = session_cuts.SessionRatingCuts(args)
    model = sac_rlhf.RewardEnsemble.from_args(3, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.reward_net_lr)
    stats = training(model, optimizer, prefs, None, args, np.random.default_rng(0), torch.device("cpu"))
    assert stats["rated_pairs_ordered"] > 0.9 and stats["epochs"] > 1, stats
    segments, masks = torch.as_tensor(prefs.obs_actions), torch.as_tensor(prefs.masks, dtype=torch.float32)
    learned = sac_rlhf.segment_returns(model, segments, masks).mean(0).numpy()
    slope = np.polyfit(returns.ravel(), learned.ravel(), 1)[0]  # the model's returns per true return
    cuts = session_cuts.ordered_cuts(training.cut_parameters).detach()
    moved = (cuts[:, 1] - cuts[:, 0]).mean(0).numpy() / slope
    assert 0.5 < moved.mean() < 1.5 and moved[0] > moved[-1], moved
    everything = np.arange(len(prefs))
    own = training.rating_accuracy(model, prefs, everything, torch.device("cpu"))
    for session in (0, 1):  # every label read on one session's scale: fewer clips get their rating
        training.sessions = lambda prefs, indices, session=session: np.full(len(indices), session)
        assert training.rating_accuracy(model, prefs, everything, torch.device("cpu")) < own - 0.05, session


def test_a_windmill_rating_run_fits_each_sessions_cuts_and_resumes_exactly(session_cuts, chdir_tmp, patched_accuracy):
    """A real windmill run rating pairs of clips on a scale of 5, four sessions of 25: every session's cut points
    leave their start and differ from the others', the run's checkpoint keeps them, and a run stopped between two
    sessions and resumed ends as the run that never stopped, cut points and their optimiser included."""

    def args(run_name: str, **overrides):
        settings = {"total_timesteps": 500, "checkpoint_frequency": 250} | overrides
        return tiny(
            session_cuts, run_name=run_name, teacher_objective="windmill-clockwise", rating_scale=5,
            learning_starts=100, total_explore_steps=100, teacher_feedback_frequency=100,
            teacher_feedback_total_queries=100,
            teacher_feedback_schedule="linear", batch_size=32, actor_hidden_dim=32, critic_hidden_dim=32,
            reward_net_hidden_dim=32, reward_net_epochs=20, teacher_feedback_num_queries_per_session=25, **settings,
        )  # fmt: skip

    session_cuts.main(args("whole"))
    whole = final_state("whole")
    state = whole["checkpoint"]["reward_training"]
    cuts = session_cuts.ordered_cuts(state["cut_parameters"])
    start = session_cuts.ordered_cuts(session_cuts.starting_cut_parameters(3, 5, 4))
    assert cuts.shape == start.shape == (3, 4, 4)
    assert ((cuts - start).abs().amax(-1) > 0.05).all(), cuts - start  # every member's set of every session moved
    assert ((cuts[:, 1:] - cuts[:, :1]).abs().amax(-1) > 0.01).all()  # and the sessions' sets are not one set
    assert len(state["cut_optimizer"]["state"]) == 1

    session_cuts.main(args("part", total_timesteps=250))
    session_cuts.main(args("part", resume="models/part/latest"))
    resumed = final_state("part")
    assert_same_training(whole, resumed)
    assert torch.equal(resumed["checkpoint"]["reward_training"]["cut_parameters"], state["cut_parameters"])


def test_bad_settings_are_refused_in_one_line(session_cuts):
    with pytest.raises(sac_rlhf.ConfigError, match="set --rating-scale N, got 0"):
        session_cuts.main(session_cuts.Args(rating_scale=0))
    with pytest.raises(sac_rlhf.ConfigError, match="--rating-cut-lr must be > 0, got 0.0"):
        session_cuts.main(session_cuts.Args(rating_scale=5, rating_cut_lr=0.0))


def test_a_benchmarks_preference_flags_pick_the_variant_whose_setting_they_set():
    common = bench_module("common")
    assert common.preference_script("--rating-scale 10 --teacher-feedback-schedule linear") == "sac_rlhf.py"
    assert common.preference_script("--rating-scale 10 --rating-cut-lr=0.03").endswith("bench/session_rating_cuts.py")
    assert common.preference_script("--reset-agent-below-correlation 0.9") == "sac_rlhf_agent_reset.py"
    with pytest.raises(SystemExit, match="set two variants' settings"):
        common.preference_script("--reset-agent-below-correlation 0.9 --rating-cut-lr 0.03")
