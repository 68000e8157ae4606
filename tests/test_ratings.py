"""Ratings of a query's clips on a scale (--rating-scale n): how they are written as a label; the ordered logit on the
reward model's segment returns and its learned cut points; the synthetic teacher's ratings, anchored on the clips it
has seen, with B-Pref's noise; a reward model learning the true preference from ratings alone; and ratings through
both scripts, their label log and file mode."""

import json
import math
import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import small_args
from test_pref_ppo import hopper_args

import pref_ppo
import sac_rlhf
import sac_rlhf_mistake_aware
import sac_rlhf_rime
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.feedback import SyntheticTeacher, answer_label, query_pair_labels
from cleanrlhf_utils.ratings import clip_ratings, rating_labels, rating_pair_labels, ratings_problem

CPU = torch.device("cpu")


# --- How ratings are written ---------------------------------------------------------------------------------------
def test_ratings_are_written_as_one_number_and_read_back():
    rng = np.random.default_rng(0)
    for scale, clips in [(2, 2), (5, 3), (10, 6)]:
        ratings = rng.integers(0, scale, size=(500, clips))
        labels = rating_labels(ratings, scale)
        assert labels.dtype == np.float32 and len(np.unique(labels)) == len({tuple(r) for r in ratings.tolist()})
        np.testing.assert_array_equal(clip_ratings(labels, clips, scale), ratings)
    assert rating_labels(np.array([[9] * 6]), 10)[0] == 999_999  # the largest label, exact in float32
    # clip 0 is the lowest digit: clip 0 rated 2 (1 less one), clip 1 rated 5 (4): 1 + 4 * 5
    assert rating_labels(np.array([[1, 4]]), 5)[0] == 21
    # An answer from the page: ratings 1 .. n, in the order the clips were shown.
    assert answer_label({"choice": "rated", "ratings": [2, 5]}, 5) == 21


def test_what_ratings_say_of_each_pair_of_clips():
    labels = rating_labels(np.array([[0, 3, 3], [4, 1, 0]]), 5)  # pairs (0, 1), (0, 2), (1, 2)
    np.testing.assert_array_equal(rating_pair_labels(labels, 3, 5), [[1, 1, 0.5], [0, 0, 0]])
    np.testing.assert_array_equal(query_pair_labels(labels, 3, 5), rating_pair_labels(labels, 3, 5))
    np.testing.assert_array_equal(query_pair_labels(np.array([1.0, 0.5]), 2, 0), [1.0, 0.5])  # a pair's own


@pytest.mark.parametrize(
    ("ratings", "problem"),
    [
        ([3, 5], None),
        ([3], "1 ratings given; rate each of the 2 clips once, in the order shown"),
        ([3, 6], "ratings [6] are off the scale; rate each clip from 1 (worst) to 5 (best)"),
        ([0, 2], "ratings [0] are off the scale"),
        ([3, "5"], "ratings are a list of integers, one per clip, got [3, '5']"),
        ([True, 2], "ratings are a list of integers"),
        ("35", "ratings are a list of integers"),
    ],
)
def test_a_persons_ratings_are_checked_against_the_query(ratings, problem):
    found = ratings_problem(ratings, 2, 5)
    assert found == problem if problem is None else found.startswith(problem), found


# --- The ordered logit ---------------------------------------------------------------------------------------------
def test_the_ordered_logit_gives_a_distribution_over_each_clips_rating(algo):
    model = algo.PREFERENCE_MODEL
    returns = torch.tensor([[[-3.0, 0.0, 0.4, 9.0]], [[1.0, 2.0, -1.0, 0.0]]])  # (E = 2, N = 1, k = 4)
    cuts = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [-2.0, -1.0, 1.0, 3.0]])  # a scale of 5
    p = model.rating_probabilities(returns, cuts)
    assert p.shape == (2, 1, 4, 5) and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 1, 4))
    # P(rating > c) = sigmoid(R - cut_c): of member 0's first clip, P(rating 0) = 1 - sigmoid(-3 + 1)
    torch.testing.assert_close(p[0, 0, 0, 0], 1 - torch.sigmoid(torch.tensor(-2.0)))
    torch.testing.assert_close(p[0, 0, 2, 2], torch.sigmoid(torch.tensor(0.4)) - torch.sigmoid(torch.tensor(-0.1)))
    assert p[0, 0, 3].argmax() == 4 and p[0, 0, 0].argmax() == 0  # a high return rates at the top
    # The loss: each clip's -log P(its rating), summed over the query's clips, averaged over queries and members.
    ratings = torch.tensor([[0, 1, 2, 4]])
    labels = torch.as_tensor(rating_labels(ratings.numpy(), 5)).expand(2, 1)
    expected = -p.gather(-1, ratings.expand(2, 1, 4)[..., None]).log().sum((-1, -2)).mean()
    torch.testing.assert_close(model.loss(returns, labels, cuts), expected)
    # Without cuts the same returns and labels are comparisons: Plackett-Luce's loss.
    pair_returns, pair_labels = torch.tensor([[0.3, 1.2]]), torch.tensor([1.0])
    torch.testing.assert_close(model.loss(pair_returns, pair_labels), sac_rlhf.PlackettLuce().loss(pair_returns, pair_labels))


def test_the_reward_models_cut_points_stay_ordered_and_are_trained(algo):
    model = algo.RewardEnsemble(4, ensemble_size=3, hidden_dim=8, hidden_layers=1, rating_scale=5)
    cuts = model.rating_cuts()
    assert cuts.shape == (3, 4)
    torch.testing.assert_close(cuts[0], torch.tensor([-1.5, -0.5, 0.5, 1.5]))  # centred, a return apart
    assert "rating_cut_parameters" in dict(model.named_parameters())  # the optimiser moves them
    with torch.no_grad():
        model.rating_cut_parameters.normal_(0, 5)
    assert (model.rating_cuts().diff(dim=-1) > 0).all()  # any parameters give increasing cuts
    assert algo.RewardEnsemble(4).rating_cuts() is None


# --- The synthetic teacher -----------------------------------------------------------------------------------------
def constant_sets(returns) -> np.ndarray:
    """Queries whose clips earn their return evenly over 5 steps: (N, k) -> (N, k, 5)."""
    returns = np.asarray(returns, dtype=np.float64)
    return np.repeat(returns[..., None] / 5, 5, axis=-1)


def rater(scale=5, beta=-1.0, gamma=1.0, eps_mistake=0.0, eps_skip=0.0, seed=0) -> SyntheticTeacher:
    return SyntheticTeacher(beta, gamma, eps_mistake, eps_skip, 0.0, seed=seed, rating_scale=scale)


def test_the_perfect_teacher_rates_on_equal_bins_between_the_worst_and_best_clip_seen():
    teacher = rater()
    labels = teacher.label_true_rewards(constant_sets([[0.0, 10.0], [1.9, 2.1], [5.0, 9.99]]))
    np.testing.assert_array_equal(clip_ratings(labels, 2, 5), [[0, 4], [0, 1], [2, 4]])
    # A better clip stretches the scale: the same return rates lower than it did.
    later = teacher.label_true_rewards(constant_sets([[5.0, 20.0]]))
    np.testing.assert_array_equal(clip_ratings(later, 2, 5), [[1, 4]])
    # The range is part of the teacher's state: a resumed run rates as the uninterrupted one.
    resumed = rater(seed=7)
    resumed.load_state_dict(json.loads(json.dumps(teacher.state_dict())))
    np.testing.assert_array_equal(resumed.label_true_rewards(constant_sets([[10.0, 12.0]])), rating_labels(np.array([[2, 3]]), 5))


def test_a_rational_teacher_draws_ratings_from_the_ordered_logit():
    teacher = rater(scale=3, beta=1.0, seed=1)
    teacher.rated_range = [0.0, 3.0]  # bins [0, 1), [1, 2), [2, 3]: cut points 1 and 2
    labels = teacher.label_true_rewards(constant_sets([[1.5, 0.0]] * 20_000))
    drawn = np.bincount(clip_ratings(labels, 2, 3)[:, 0], minlength=3) / len(labels)
    cuts = torch.tensor([[1.0, 2.0]])
    expected = sac_rlhf.PREFERENCE_MODEL.rating_probabilities(torch.tensor([[[1.5]]]), cuts)[0, 0, 0].numpy()
    np.testing.assert_allclose(drawn, expected, atol=0.012)
    uniform = rater(scale=3, beta=0.0, seed=2).label_true_rewards(constant_sets([[1.5, 0.0]] * 6000))
    np.testing.assert_allclose(np.bincount(clip_ratings(uniform, 2, 3).ravel()) / 12_000, np.full(3, 1 / 3), atol=0.02)


def test_a_mistake_is_another_rating_drawn_uniformly_and_a_skip_is_nan():
    returns = constant_sets([[0.0, 10.0]] * 5000)  # rated 1 and 5 (0 and 4 less one)
    ratings = clip_ratings(rater(eps_mistake=1.0, seed=3).label_true_rewards(returns), 2, 5)
    assert (ratings[:, 0] != 0).all() and (ratings[:, 1] != 4).all()
    np.testing.assert_allclose(np.bincount(ratings[:, 0], minlength=5)[1:] / 5000, np.full(4, 0.25), atol=0.025)
    some = clip_ratings(rater(eps_mistake=0.3, seed=4).label_true_rewards(returns), 2, 5)
    assert abs((some != [0, 4]).mean() - 0.3) < 0.03
    skipping = rater(eps_skip=0.5)
    skipping.set_margin(10.0)  # skip queries whose clips all return below 5
    labels = skipping.label_true_rewards(constant_sets([[1.0, 4.0], [0.0, 8.0]]))
    assert np.isnan(labels[0]) and labels[1] == rating_labels(np.array([[0, 4]]), 5)[0]


def test_a_myopic_teacher_rates_by_the_late_steps():
    early, late = [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.9]
    labels = rater(scale=2, gamma=0.5).label_true_rewards(np.array([[early, late]]))
    np.testing.assert_array_equal(clip_ratings(labels, 2, 2), [[0, 1]])  # the late step weighs 16 times more


# --- Learning from ratings -----------------------------------------------------------------------------------------
def test_a_reward_model_trained_on_synthetic_ratings_learns_the_true_preference(algo):
    """The true reward is the first observation feature; a perfect teacher rates pairs of clips on a scale of 5. The
    model learns the ratings, and orders fresh pairs as the true reward does: ratings teach comparisons."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    obs_dim, length, clips = 3, 10, 2
    rb = ReplayBuffer(3000, obs_dim, 1, 1)
    for step in range(3000):
        obs = rng.normal(size=obs_dim).astype(np.float32)
        rb.add(obs, obs, rng.uniform(-1, 1, 1), obs[0], 0.0, step // 100, np.zeros(1))
    args = algo.Args(segment_length=length, clips_per_query=clips, rating_scale=5, max_augmentation_offset=3, min_augmentation_offset=1)
    args = replace(args, reward_net_epochs=40, reward_net_hidden_dim=32, reward_net_batch_size=32)  # SURF on: pairs
    idx, mask = rb.sample_segment_sets(200, clips, length, rng)
    segments = rb.gather_segments(idx, mask)
    labels = rater().label_true_rewards(segments["true_rewards"])
    prefs = algo.PreferenceBuffer(length, obs_dim + 1, 1, clips)
    arrays = (segments["obs_actions"], segments["masks"], segments["true_rewards"], segments["physics_states"])
    prefs.add(*arrays, labels, np.zeros(len(labels), bool), 0)
    model = algo.RewardEnsemble(obs_dim + 1, 3, 32, 2, rating_scale=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    untrained = algo.rating_accuracy(model, prefs, np.arange(len(prefs)), CPU)
    cuts_before = model.rating_cuts().detach().clone()
    stats = algo.train_reward_model(model, optimizer, prefs, rb, args, rng, CPU)
    assert stats["train_loss"] < 0.7 * 2 * math.log(5)  # a uniform model's loss of two clips' ratings: 2 ln 5 = 3.2
    accuracy = algo.preference_accuracy(model, prefs, np.arange(len(prefs)), CPU)  # exact ratings of every clip
    assert accuracy > 0.6 and accuracy > untrained + 0.3, (untrained, accuracy)
    assert not torch.equal(model.rating_cuts(), cuts_before)

    fresh_idx, fresh_mask = rb.sample_segment_pairs(500, length, np.random.default_rng(1))
    fresh = rb.gather_segments(fresh_idx, fresh_mask)
    p = algo.preference_probabilities(model, torch.as_tensor(fresh["obs_actions"]), torch.as_tensor(fresh["masks"], dtype=torch.float32))
    truth = fresh["true_rewards"].sum(-1)
    agree = (p.mean(0).numpy() > 0.5) == (truth[:, 1] > truth[:, 0])
    assert agree.mean() > 0.85, agree.mean()
    learned, _ = algo.predict_reward_arrays(model, CPU, rb.obs_actions(np.arange(3000)))
    assert np.corrcoef(learned, rb.true_rewards[:3000])[0, 1] > 0.9


# --- Settings ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rating_scale": 1}, "--rating-scale must be 0 (queries compared or ranked) or in [2, 10], got 1"),
        ({"rating_scale": 11}, "--rating-scale must be 0 (queries compared or ranked) or in [2, 10], got 11"),
        ({"rating_scale": 5, "teacher_eps_equal": 0.1}, "--teacher-eps-equal 0.1 calls ties of a pair, and ratings on a scale of 5"),
    ],
)
def test_bad_rating_settings_are_refused_in_one_line(algo, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        algo.validate_args(algo.Args(**overrides))


def test_ratings_are_refused_where_only_pairs_are_learned():
    with pytest.raises(ConfigError, match="RIME splits and flips pairs' labels: ratings are not learned here, got --rating-scale 5"):
        sac_rlhf_rime.validate_args(sac_rlhf_rime.Args(rating_scale=5))
    with pytest.raises(ConfigError, match="the mistake-aware loss flips a pair's label: it learns no ratings, got --rating-scale 3"):
        sac_rlhf_mistake_aware.validate_args(sac_rlhf_mistake_aware.Args(rating_scale=3))


# --- Ratings through both scripts ----------------------------------------------------------------------------------
def sac_args(run_name: str, **overrides) -> sac_rlhf.Args:
    """test_end_to_end's small PEBBLE run, shorter: sessions at 400 and 600 steps, 12 queries."""
    settings = {"total_timesteps": 700, "teacher_feedback_total_queries": 12, "teacher_feedback_num_queries_per_session": 6}
    return small_args(run_name, teacher_feedback_frequency=200, **settings | overrides)


def ppo_args(run_name: str, **overrides) -> pref_ppo.Args:
    """test_pref_ppo's Hopper run, shorter: sessions after the rollouts reaching 1024 and 1536 steps, 12 queries."""
    settings = {"total_timesteps": 2048, "teacher_feedback_total_queries": 12, "teacher_feedback_num_queries_per_session": 6}
    return hopper_args(run_name, **settings | overrides)


def stored_ratings(run: str) -> tuple[list, np.ndarray, list[np.ndarray], set]:
    """The label log's rows: each one's segment shape, label, segments' true returns, and the scales recorded."""
    db = sqlite3.connect(f"runs/{run}/labels.sqlite")
    rows = db.execute("SELECT label, true_rewards, shapes, rating_scale FROM labels ORDER BY id").fetchall()
    db.close()
    shapes = [json.loads(shape)["masks"][0] for _, _, shape, _ in rows]
    returns = [np.frombuffer(blob, np.float32).reshape(json.loads(shape)["true_rewards"][0]).sum(-1) for _, blob, shape, _ in rows]
    return shapes, np.array([row[0] for row in rows]), returns, {row[3] for row in rows}


@pytest.mark.parametrize(("module", "make_args", "clips"), [(sac_rlhf, sac_args, 2), (pref_ppo, ppo_args, 3)])
def test_a_run_learns_from_ratings_and_logs_them_for_file_mode(chdir_tmp, module, make_args, clips):
    summary = module.main(make_args("rated", clips_per_query=clips, rating_scale=4))
    assert summary["labels_obtained"] == 12
    shapes, labels, returns, scales = stored_ratings("rated")
    assert shapes == [[clips, 20]] * 12 and scales == {4}
    # Within the first session, a clip with a higher true return is never rated lower (a perfect teacher's bins).
    first = clip_ratings(labels[:6], clips, 4), np.stack(returns[:6])
    for i, j in zip(*np.triu_indices(clips, 1)):
        higher = first[1][:, i] > first[1][:, j]
        assert (first[0][higher, i] >= first[0][higher, j]).all()
    assert len(np.unique(clip_ratings(labels, clips, 4))) >= 3  # the scale is used, not one point of it
    checkpoint = torch.load("models/rated/latest/checkpoint.pt", weights_only=False)
    assert checkpoint["reward_model"]["rating_cut_parameters"].shape == (3, 3)
    assert checkpoint["teacher"]["rated_range"][0] < checkpoint["teacher"]["rated_range"][1]
    assert 0 < summary["train_accuracy"] <= 1.0  # of each clip's exact rating

    # File mode replays the ratings; a run asking another kind of query is refused before it starts.
    replay = replace(make_args("replayed", clips_per_query=clips, rating_scale=4, teacher_feedback_mode="file"))
    replay = replace(replay, feedback_file="runs/rated/labels.sqlite")
    assert module.main(replay)["labels_obtained"] == 12
    np.testing.assert_array_equal(stored_ratings("replayed")[1], labels)
    with pytest.raises(
        ConfigError, match=f"holds labels of {clips} clips each rated on a scale of 4; give --clips-per-query {clips} --rating-scale 4"
    ):
        module.main(replace(replay, run_name="unrated", rating_scale=0))
    assert not Path("runs/unrated").exists()
