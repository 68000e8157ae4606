"""Rankings of k clips (--clips-per-query 3..6): the Plackett-Luce likelihood, which is Bradley-Terry for k = 2; how a
ranking is written as a label; the synthetic teacher's rankings with B-Pref's noise; query selection of the sets the
ensemble disputes most; a reward model learning from rankings; and rankings through both scripts, their label log and
file mode."""

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
from cleanrlhf_utils.feedback import SyntheticTeacher
from cleanrlhf_utils.rankings import clip_pairs, order_labels, orders, pair_labels, places

CPU = torch.device("cpu")


# --- Plackett-Luce ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plackett_luce_of_two_clips_is_todays_bradley_terry_loss_ties_included(algo, dtype):
    """The general formula (every order's log-probability, weighed by the label) against Bradley-Terry's cross-entropy:
    labels 0 and 1 are the orders (0, 1) and (1, 0); a tie, 0.5, weighs both orders by half, as the cross-entropy does."""
    torch.manual_seed(0)
    returns = 20 * torch.randn(3, 64, 2, dtype=dtype)  # up to saturated margins
    labels = torch.tensor([0.0, 1.0, 0.5], dtype=dtype).repeat(3, 22)[:, :64]
    plackett_luce, bradley_terry = algo.PlackettLuce(), algo.BradleyTerry()
    # Float precision: a few units in the last place of the returns (the two forms round saturated margins apart).
    tolerance = {"rtol": 1e-6, "atol": 8 * torch.finfo(dtype).eps * float(returns.abs().max())}
    torch.testing.assert_close(plackett_luce.order_loss(returns, labels), bradley_terry.loss(returns, labels), **tolerance)
    for label in (0.0, 1.0, 0.5):  # each kind of label on its own, not only on average
        alone = torch.full((3, 64), label, dtype=dtype)
        torch.testing.assert_close(plackett_luce.order_loss(returns, alone), bradley_terry.loss(returns, alone), **tolerance)
    orders_first = plackett_luce.order_log_probabilities(returns)
    torch.testing.assert_close(orders_first, bradley_terry.log_probabilities(returns), **tolerance)
    # The script's model answers a pair with Bradley-Terry's own expressions: the pairs' numbers bit for bit.
    assert torch.equal(algo.PREFERENCE_MODEL.loss(returns, labels), bradley_terry.loss(returns, labels))
    assert torch.equal(algo.PREFERENCE_MODEL.probability(returns), bradley_terry.probability(returns))


@pytest.mark.parametrize("clips", [3, 4, 6])
def test_plackett_luce_gives_a_distribution_over_orders_whose_pairs_are_bradley_terry(clips):
    torch.manual_seed(clips)
    returns = 3 * torch.randn(5, clips, dtype=torch.float64)
    model = sac_rlhf.PREFERENCE_MODEL
    order_p = model.order_log_probabilities(returns).exp()  # (5, k!)
    torch.testing.assert_close(order_p.sum(-1), torch.ones(5, dtype=torch.float64))
    # The best clip is chosen by softmax(R): the first place's marginal.
    first = torch.stack([order_p[:, orders(clips)[:, 0] == c].sum(-1) for c in range(clips)], -1)
    torch.testing.assert_close(first, torch.softmax(returns, -1))
    # Each pair of clips is ranked as Bradley-Terry ranks it (Luce's choice axiom): what selection and accuracy ask.
    ranked = torch.as_tensor(np.argsort(orders(clips), axis=-1))  # each order's places of the clips
    i, j = clip_pairs(clips)
    above = torch.stack([order_p[:, ranked[:, b] < ranked[:, a]].sum(-1) for a, b in zip(i, j, strict=True)], -1)
    torch.testing.assert_close(model.probability(returns), above)
    # The loss of a strict ranking is minus its order's log-probability.
    labels = torch.tensor([0.0, 5.0, 1.0, 2.0, 3.0])
    expected = -model.order_log_probabilities(returns)[torch.arange(5), labels.long()].mean()
    torch.testing.assert_close(model.loss(returns, labels), expected)


def test_a_ranking_is_written_as_its_orders_lexicographic_index():
    for clips in range(2, 7):
        assert len(orders(clips)) == math.factorial(clips)
        np.testing.assert_array_equal(order_labels(orders(clips)), np.arange(math.factorial(clips)))
    np.testing.assert_array_equal(orders(2), [[0, 1], [1, 0]])  # label 1: segment 1 first, a pair's label
    label = order_labels(np.array([[2, 0, 1]]))  # clip 2 best, then 0, then 1
    np.testing.assert_array_equal(places(label, 3), [[1, 2, 0]])
    # pairs (0, 1), (0, 2), (1, 2): 1 where the second clip is ranked above the first
    np.testing.assert_array_equal(pair_labels(label, 3), [[0.0, 1.0, 1.0]])
    ties = np.array([0.0, 1.0, 0.5], np.float32)
    assert pair_labels(ties, 2) is ties  # a pair's label is its own


# --- The synthetic teacher's rankings ----------------------------------------------------------------------------------
def constant_sets(returns) -> np.ndarray:
    """true_rewards (N, k, 5) whose segments return `returns` (N, k), spread evenly over their steps."""
    returns = np.asarray(returns, dtype=np.float64)
    return np.repeat(returns[..., None] / 5, 5, axis=-1)


def teacher(beta=-1.0, gamma=1.0, eps_mistake=0.0, eps_skip=0.0, seed=0) -> SyntheticTeacher:
    return SyntheticTeacher(beta, gamma, eps_mistake, eps_skip, 0.0, seed=seed)


def test_the_perfect_teacher_ranks_by_true_return():
    returns = np.random.default_rng(0).normal(size=(200, 4))
    labels = teacher().label_true_rewards(constant_sets(returns))
    np.testing.assert_array_equal(orders(4)[labels.astype(int)], np.argsort(-returns, axis=-1))
    # Equal returns: the order among them is drawn, not always the first clip first.
    tied = teacher().label_true_rewards(constant_sets(np.zeros((300, 3))))
    assert len(np.unique(tied)) == 6


def test_a_rational_teacher_draws_its_ranking_from_plackett_luce_at_its_temperature():
    returns = np.array([[0.0, 1.0, 2.0]] * 20_000)
    labels = teacher(beta=1.0, seed=1).label_true_rewards(constant_sets(returns))
    drawn = np.bincount(labels.astype(int), minlength=6) / len(labels)
    expected = sac_rlhf.PREFERENCE_MODEL.order_log_probabilities(torch.tensor([0.0, 1.0, 2.0])).exp().numpy()
    np.testing.assert_allclose(drawn, expected, atol=0.012)
    uniform = teacher(beta=0.0, seed=2).label_true_rewards(constant_sets(returns))
    np.testing.assert_allclose(np.bincount(uniform.astype(int)) / len(uniform), np.full(6, 1 / 6), atol=0.012)


def test_a_mistake_is_another_ranking_drawn_uniformly_and_a_skip_is_nan():
    returns = np.array([[3.0, 2.0, 1.0]] * 6000)  # the true order (0, 1, 2): label 0
    labels = teacher(eps_mistake=1.0, seed=3).label_true_rewards(constant_sets(returns))
    assert (labels != 0).all()
    np.testing.assert_allclose(np.bincount(labels.astype(int), minlength=6)[1:] / len(labels), np.full(5, 0.2), atol=0.02)
    some = teacher(eps_mistake=0.3, seed=4).label_true_rewards(constant_sets(returns))
    assert abs((some != 0).mean() - 0.3) < 0.03
    skipping = teacher(eps_skip=0.5)
    skipping.set_margin(10.0)  # skip queries whose clips all return below 5
    labels = skipping.label_true_rewards(constant_sets([[1.0, 2.0, 4.0], [1.0, 6.0, 2.0]]))
    assert np.isnan(labels[0]) and labels[1] == order_labels(np.array([[1, 2, 0]]))[0]


def test_a_myopic_teacher_ranks_by_the_late_steps():
    early, late = [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.9]
    rewards = np.array([[early, late, [0.0] * 5]])
    assert orders(3)[int(teacher(gamma=0.5).label_true_rewards(rewards)[0])].tolist() == [1, 0, 2]
    assert orders(3)[int(teacher(gamma=1.0).label_true_rewards(rewards)[0])].tolist() == [0, 1, 2]


# --- Query selection ---------------------------------------------------------------------------------------------------
EPISODE = 40


def test_select_queries_picks_the_sets_the_ensemble_disputes_most(algo):
    rng = np.random.default_rng(0)
    n, clips = 400, 3
    hot = np.isin(np.arange(n) // EPISODE, [2, 7])  # the only steps where members disagree
    rb = ReplayBuffer(500, 2, 1, 1)
    for step in range(n):
        obs = np.array([hot[step], rng.uniform(-1, 1)], dtype=np.float32)
        rb.add(obs, obs, np.zeros(1), 0.0, 0.0, step // EPISODE, np.zeros(1))
    weights = [[2.0, 1.0, 0.0], [-2.0, 1.0, 0.0], [0.0, 1.0, 0.0]]  # x0 with opposite signs, x1 alike
    model = algo.RewardEnsemble(3, ensemble_size=3, hidden_dim=8, hidden_layers=0)
    with torch.no_grad():
        model.net[-1].weight.copy_(torch.tensor(weights)[..., None])
        model.net[-1].bias.zero_()
    count, length, factor = 5, 10, 10
    idx, mask = algo.select_queries("disagree", model, rb, count, length, factor, np.random.default_rng(3), CPU, 0, clips)
    assert idx.shape == (count, clips, length) and mask.shape == (count, clips, length)
    assert all(len(set(starts)) == clips for starts in idx[:, :, 0].tolist())  # distinct clips in each set

    # The pool the sampler drew (the same generator state), scored in numpy: the mean over a set's pairs of clips of
    # the members' spread of P(clip j > clip i).
    pool_idx, pool_mask = rb.sample_segment_sets(count * factor, clips, length, np.random.default_rng(3))
    x = np.stack([hot[pool_idx], rb.obs[pool_idx, 1]], axis=-1)  # (P, k, L, 2)
    returns = (np.tanh(np.einsum("pklf,ef->epkl", x, np.array(weights)[:, :2])) * pool_mask).sum(-1)  # (E, P, k)
    first, second = clip_pairs(clips)
    p = 1 / (1 + np.exp(-(returns[..., second] - returns[..., first])))
    disputed = p.std(0).mean(-1)
    keys = {tuple(starts) for starts in idx[:, :, 0].tolist()}
    assert keys == {tuple(starts) for starts in pool_idx[np.argsort(-disputed)[:count], :, 0].tolist()}
    pool_hot = (hot[pool_idx] & pool_mask).any(axis=(1, 2))
    assert pool_hot.sum() < len(pool_hot) and (hot[idx] & mask).any(axis=(1, 2)).all()  # a random pick gets calm sets
    entropy_idx, _ = algo.select_queries("entropy", model, rb, count, length, factor, rng, CPU, 0, clips)
    assert entropy_idx.shape == (count, clips, length)


# --- Learning from rankings -----------------------------------------------------------------------------------------------
def test_a_reward_model_trained_on_synthetic_rankings_learns_the_true_preference(algo):
    """The true reward is the first observation feature; a perfect teacher ranks sets of four clips by it. The model
    learns to rank fresh pairs as the true reward does."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    obs_dim, length, clips = 3, 10, 4
    rb = ReplayBuffer(3000, obs_dim, 1, 1)
    for step in range(3000):
        obs = rng.normal(size=obs_dim).astype(np.float32)
        rb.add(obs, obs, rng.uniform(-1, 1, 1), obs[0], 0.0, step // 100, np.zeros(1))
    args = algo.Args(segment_length=length, clips_per_query=clips, max_augmentation_offset=3, min_augmentation_offset=1)
    args = replace(args, reward_net_epochs=20, reward_net_hidden_dim=32, reward_net_batch_size=32, surf=False)
    idx, mask = rb.sample_segment_sets(100, clips, length, rng)
    segments = rb.gather_segments(idx, mask)
    labels = teacher().label_true_rewards(segments["true_rewards"])
    prefs = algo.PreferenceBuffer(length, obs_dim + 1, 1, clips)
    arrays = (segments["obs_actions"], segments["masks"], segments["true_rewards"], segments["physics_states"])
    prefs.add(*arrays, labels, np.zeros(len(labels), bool), 0)
    model = algo.RewardEnsemble(obs_dim + 1, 3, 32, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    stats = algo.train_reward_model(model, optimizer, prefs, rb, args, rng, CPU)
    assert stats["train_loss"] < math.log(24) / 2  # a random model's loss of a ranking of 4 is ln 24 = 3.2
    assert algo.preference_accuracy(model, prefs, np.arange(len(prefs)), CPU) > 0.9  # over every pair in the rankings

    fresh_idx, fresh_mask = rb.sample_segment_pairs(500, length, np.random.default_rng(1))
    fresh = rb.gather_segments(fresh_idx, fresh_mask)
    p = algo.preference_probabilities(model, torch.as_tensor(fresh["obs_actions"]), torch.as_tensor(fresh["masks"], dtype=torch.float32))
    truth = fresh["true_rewards"].sum(-1)
    agree = (p.mean(0).numpy() > 0.5) == (truth[:, 1] > truth[:, 0])
    assert agree.mean() > 0.85, agree.mean()
    learned, _ = algo.predict_reward_arrays(model, CPU, rb.obs_actions(np.arange(3000)))
    assert np.corrcoef(learned, rb.true_rewards[:3000])[0, 1] > 0.9


# --- Settings ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clips_per_query": 7}, "--clips-per-query must be in [2, 6], got 7"),
        ({"clips_per_query": 1}, "--clips-per-query must be in [2, 6], got 1"),
        ({"clips_per_query": 3, "teacher_eps_equal": 0.1}, "--teacher-eps-equal 0.1 calls ties"),
    ],
)
def test_bad_ranking_settings_are_refused_in_one_line(algo, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        algo.validate_args(algo.Args(**overrides))


def test_rankings_are_refused_where_only_pairs_are_learned(algo, chdir_tmp):
    algo.validate_args(algo.Args(clips_per_query=3, teacher_feedback_mode="human"))  # the page ranks up to 6 clips
    with pytest.raises(ConfigError, match="RIME splits and flips pairs' labels: --clips-per-query must be 2, got 4"):
        sac_rlhf_rime.validate_args(sac_rlhf_rime.Args(clips_per_query=4))
    with pytest.raises(ConfigError, match="the mistake-aware loss flips a pair's label: --clips-per-query must be 2"):
        sac_rlhf_mistake_aware.validate_args(sac_rlhf_mistake_aware.Args(clips_per_query=3))


# --- Rankings through both scripts ---------------------------------------------------------------------------------------
def sac_args(run_name: str, **overrides) -> sac_rlhf.Args:
    """test_end_to_end's small PEBBLE run, shorter: sessions at 400 and 600 steps, 12 queries."""
    settings = {"total_timesteps": 700, "teacher_feedback_total_queries": 12, "teacher_feedback_num_queries_per_session": 6}
    return small_args(run_name, teacher_feedback_frequency=200, **settings | overrides)


def ppo_args(run_name: str, **overrides) -> pref_ppo.Args:
    """test_pref_ppo's Hopper run, shorter: sessions after the rollouts reaching 1024 and 1536 steps, 12 queries."""
    settings = {"total_timesteps": 2048, "teacher_feedback_total_queries": 12, "teacher_feedback_num_queries_per_session": 6}
    return hopper_args(run_name, **settings | overrides)


def stored_rankings(run: str) -> tuple[list[list[int]], np.ndarray, list[np.ndarray]]:
    """The label log's rankings: each row's segment shape, its label and its segments' true returns."""
    db = sqlite3.connect(f"runs/{run}/labels.sqlite")
    rows = db.execute("SELECT label, true_rewards, shapes FROM labels ORDER BY id").fetchall()
    db.close()
    shapes = [json.loads(shape)["masks"][0] for _, _, shape in rows]
    returns = [np.frombuffer(blob, np.float32).reshape(json.loads(shape)["true_rewards"][0]).sum(-1) for _, blob, shape in rows]
    return shapes, np.array([label for label, _, _ in rows]), returns


@pytest.mark.parametrize(("module", "make_args", "clips"), [(sac_rlhf, sac_args, 3), (pref_ppo, ppo_args, 4)])
def test_a_run_learns_from_rankings_and_logs_them_for_file_mode(chdir_tmp, module, make_args, clips):
    summary = module.main(make_args("ranked", clips_per_query=clips))
    assert summary["labels_obtained"] == 12
    shapes, labels, returns = stored_rankings("ranked")
    assert shapes == [[clips, 20]] * 12
    # Each label is the order of its clips' true returns (the synthetic teacher is perfect by default).
    np.testing.assert_array_equal(orders(clips)[labels.astype(int)], np.argsort(-np.stack(returns), axis=-1))
    checkpoint = torch.load("models/ranked/latest/checkpoint.pt", weights_only=False)
    assert checkpoint["preference_buffer"]["obs_actions"].shape[:2] == (12, clips)
    assert 0.5 < summary["train_accuracy"] <= 1.0  # over every pair of clips in the rankings

    # File mode replays the rankings; a run asking another number of clips is refused before it starts.
    replay = make_args("replayed", clips_per_query=clips, teacher_feedback_mode="file")
    replay = replace(replay, feedback_file="runs/ranked/labels.sqlite")
    assert module.main(replay)["labels_obtained"] == 12
    _, replayed, _ = stored_rankings("replayed")
    np.testing.assert_array_equal(replayed, labels)
    with pytest.raises(ConfigError, match=f"holds labels of {clips} clips each; give --clips-per-query {clips}"):
        module.main(replace(replay, run_name="mismatched", clips_per_query=2))
    assert not Path("runs/mismatched").exists()
