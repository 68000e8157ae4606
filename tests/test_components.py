"""Behaviour of the algorithm scripts' shared components, checked against values that are computed
independently (by hand, brute force, or from data planted so that the answer is known)."""

import functools
import math

import numpy as np
import pytest
import torch

import pref_ppo
import sac_rlhf
from cleanrlhf_utils.diagnostics import fresh_pair_accuracy
from cleanrlhf_utils.feedback import SyntheticTeacher

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------
# Reward model learns from synthetic-teacher labels
# ----------------------------------------------------------------------------------------
OBS_DIM, ACTION_DIM, SEG_LEN = 3, 1, 5
INPUT_DIM = OBS_DIM + ACTION_DIM


def true_step_reward(x: np.ndarray) -> np.ndarray:
    """A known per-step reward of (obs, action); bounded like the ensemble's tanh output."""
    return np.tanh(x[..., 0] - 0.5 * x[..., 1])


def random_pairs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, 2, SEG_LEN, INPUT_DIM)).astype(np.float32)


def preference_buffer(algo, segments: np.ndarray, labels: np.ndarray, heldout: bool):
    n = len(labels)
    prefs = algo.PreferenceBuffer(SEG_LEN, INPUT_DIM, 1)
    prefs.add(
        segments,
        np.ones((n, 2, SEG_LEN), dtype=bool),
        true_step_reward(segments),
        np.zeros((n, 2, SEG_LEN, 1)),
        labels,
        np.full(n, heldout),
        0,
    )
    return prefs


def random_replay_buffer(algo, rng: np.random.Generator, n: int = 1000, episode_length: int = 100):
    """Transitions whose (obs, action) come from the same distribution as the labelled segments."""
    rb = algo.ReplayBuffer(n, OBS_DIM, ACTION_DIM, 1)
    data = rng.standard_normal((n, INPUT_DIM)).astype(np.float32)
    for i, x in enumerate(data):
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], true_step_reward(x), 0.0, i // episode_length, np.zeros(1))
    return rb


@pytest.mark.parametrize("surf", [False, True], ids=["plain", "surf"])
def test_reward_model_learns_true_preferences(algo, surf):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    teacher = SyntheticTeacher(beta=-1.0, gamma=1.0, eps_mistake=0.0, eps_skip=0.0, eps_equal=0.0, seed=1)

    train_segments = random_pairs(rng, 200)
    train_labels = teacher.label_true_rewards(true_step_reward(train_segments))
    assert set(np.unique(train_labels)) == {0.0, 1.0}
    prefs = preference_buffer(algo, train_segments, train_labels, heldout=False)
    # Held-out pairs with deliberately WRONG labels: if training ever used the held-out split,
    # the model would be pulled towards them.
    poison_segments = random_pairs(rng, 100)
    poison_labels = 1.0 - teacher.label_true_rewards(true_step_reward(poison_segments))
    poison = preference_buffer(algo, poison_segments, poison_labels, heldout=True)
    prefs.add(*(getattr(poison, name) for name in ("obs_actions", "masks", "true_rewards", "physics_states", "labels", "heldout")), 0)

    test_segments = random_pairs(rng, 300)
    test = preference_buffer(algo, test_segments, teacher.label_true_rewards(true_step_reward(test_segments)), heldout=True)

    args = algo.Args(
        segment_length=SEG_LEN,
        reward_net_batch_size=50,
        reward_net_epochs=200,
        surf=surf,
        surf_tau=0.9,
        unlabeled_batch_ratio=1,
        min_augmentation_offset=1,
        max_augmentation_offset=2,
    )
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    untrained_accuracy = algo.preference_accuracy(model, test, test.split(True), CPU)
    stats = algo.train_reward_model(model, optimizer, prefs, random_replay_buffer(algo, rng), args, rng, CPU)

    assert stats["epochs"] >= 1
    assert algo.preference_accuracy(model, prefs, prefs.split(False), CPU) >= args.reward_net_target_accuracy
    test_accuracy = algo.preference_accuracy(model, test, test.split(True), CPU)
    assert test_accuracy >= 0.9, (untrained_accuracy, test_accuracy)
    # The wrong held-out labels were never trained on: the model disagrees with them.
    assert algo.preference_accuracy(model, prefs, prefs.split(True), CPU) <= 0.15
    if surf:
        assert stats["pseudo_labels"] > 0  # SURF's pseudo-labelled loss took part
        assert stats["ssl_loss"] > 0
    else:
        assert stats["pseudo_labels"] == 0 and stats["ssl_loss"] == 0.0


SCALE, OFFSET = np.array([300.0, 0.01, 1.0, 0.0], dtype=np.float32), np.array([-900.0, 0.3, 0.0, 7.0], dtype=np.float32)


def test_standardised_inputs_learn_a_preference_on_badly_scaled_features(algo):
    # The preference depends on features 0 and 1, stored at scales 300 and 0.01 with offsets, and the action is constant:
    # the raw (obs, action) of an env mix scales like this (angles, positions, velocities, an unused actuator).
    rng = np.random.default_rng(0)
    teacher = SyntheticTeacher(beta=-1.0, gamma=1.0, eps_mistake=0.0, eps_skip=0.0, eps_equal=0.0, seed=1)
    train, test = random_pairs(rng, 200), random_pairs(rng, 300)
    rb = random_replay_buffer(algo, rng)
    rb.obs[:], rb.actions[:] = rb.obs * SCALE[:OBS_DIM] + OFFSET[:OBS_DIM], rb.actions * SCALE[OBS_DIM:] + OFFSET[OBS_DIM:]
    accuracy = {}
    for normalize in (False, True):
        torch.manual_seed(0)
        prefs = preference_buffer(algo, train * SCALE + OFFSET, teacher.label_true_rewards(true_step_reward(train)), heldout=False)
        held = preference_buffer(algo, test * SCALE + OFFSET, teacher.label_true_rewards(true_step_reward(test)), heldout=True)
        args = algo.Args(segment_length=SEG_LEN, reward_net_batch_size=50, reward_net_epochs=30, surf=False)
        args.reward_net_normalize_inputs = normalize
        model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
        algo.train_reward_model(model, torch.optim.Adam(model.parameters(), lr=3e-3), prefs, rb, args, rng, CPU)
        accuracy[normalize] = algo.preference_accuracy(model, held, held.split(True), CPU)
        if normalize:  # the buffer's statistics, the constant column only centred
            rows = rb.obs_actions(np.arange(rb.size))
            np.testing.assert_allclose(model.input_mean.numpy(), rows.mean(0), rtol=1e-4)
            np.testing.assert_allclose(model.input_std.numpy(), [*rows.std(0)[:3], 1.0], rtol=1e-4)
        else:  # the identity
            assert not model.input_mean.any() and (model.input_std == 1).all()
    assert accuracy[True] >= 0.9 > accuracy[False] + 0.1, accuracy


# ----------------------------------------------------------------------------------------
# Bradley-Terry loss
# ----------------------------------------------------------------------------------------
def _bt_by_hand(r0: float, r1: float, y: float) -> float:
    p1 = 1.0 / (1.0 + math.exp(-(r1 - r0)))
    return -(y * math.log(p1) + (1 - y) * math.log(1 - p1))


def test_the_preference_models_loss_is_bradley_terry_by_hand(algo):
    pairs = [(1.0, 2.0, 1.0), (0.5, -0.5, 0.0), (0.0, 0.3, 0.5), (2.0, -1.0, 1.0)]
    returns = torch.tensor([[r0, r1] for r0, r1, _ in pairs], dtype=torch.float64)
    labels = torch.tensor([y for _, _, y in pairs], dtype=torch.float64)
    by_hand = [_bt_by_hand(*pair) for pair in pairs]
    assert by_hand[0] == pytest.approx(math.log(1 + math.exp(-1)))
    assert by_hand[2] == pytest.approx(0.5 * (math.log(1 + math.exp(-0.3)) + math.log(1 + math.exp(0.3))))
    loss = algo.PREFERENCE_MODEL.loss
    assert float(loss(returns, labels)) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-12)
    # Per-member returns (E, N, 2): averaged over members and pairs.
    member2 = returns.flip(-1)  # every pair reversed
    by_hand2 = [_bt_by_hand(r1, r0, y) for r0, r1, y in pairs]
    ensemble = torch.stack([returns, member2])
    expected = (sum(by_hand) + sum(by_hand2)) / (2 * len(pairs))
    assert float(loss(ensemble, labels.expand(2, -1))) == pytest.approx(expected, rel=1e-12)
    # The probability it implies, its log-probabilities and each label's loss given the probability: the same model.
    probability = algo.PREFERENCE_MODEL.probability(returns)
    torch.testing.assert_close(probability, torch.sigmoid(returns[:, 1] - returns[:, 0]))
    torch.testing.assert_close(algo.PREFERENCE_MODEL.log_probabilities(returns).exp().sum(-1), torch.ones(len(pairs), dtype=torch.float64))
    by_label = algo.PREFERENCE_MODEL.label_losses(probability, labels)
    torch.testing.assert_close(by_label, torch.tensor(by_hand, dtype=torch.float64))


def test_tie_labels_drive_preference_to_one_half(algo):
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    segments = random_pairs(rng, 64)
    prefs = preference_buffer(algo, segments, np.full(64, 0.5, dtype=np.float32), heldout=False)
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=2, hidden_dim=16, hidden_layers=1)
    with torch.no_grad():  # start far from indifference
        model.net[-1].weight.mul_(10.0)
    x, masks = torch.as_tensor(segments), torch.ones(64, 2, SEG_LEN)
    before = (algo.preference_probabilities(model, x, masks) - 0.5).abs().mean().item()
    args = algo.Args(segment_length=SEG_LEN, reward_net_batch_size=32, reward_net_epochs=40, surf=False)
    args.reward_net_normalize_inputs = False  # no replay buffer here to take statistics from
    stats = algo.train_reward_model(model, torch.optim.Adam(model.parameters(), lr=3e-3), prefs, None, args, rng, CPU)
    after = (algo.preference_probabilities(model, x, masks) - 0.5).abs().mean().item()
    assert stats["epochs"] == 40  # no accuracy on ties: never stops early
    assert before > 0.1
    assert after < 0.2 * before, (before, after)


def test_preference_probabilities_ignore_masked_steps(algo):
    torch.manual_seed(2)
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=3, hidden_dim=8, hidden_layers=1)
    segments = torch.randn(10, 2, SEG_LEN, INPUT_DIM)
    masks = torch.ones(10, 2, SEG_LEN)
    masks[:, :, 3:] = 0
    garbage = segments.clone()
    garbage[:, :, 3:] = 1e3 * torch.randn(10, 2, SEG_LEN - 3, INPUT_DIM)
    p = algo.preference_probabilities(model, segments, masks)
    assert p.shape == (3, 10)
    torch.testing.assert_close(algo.preference_probabilities(model, garbage, masks), p)
    rewards = model(segments[:, :, :3])  # (E, 10, 2, 3)
    returns = rewards.sum(-1)
    torch.testing.assert_close(p, torch.sigmoid(returns[..., 1] - returns[..., 0]).detach())


# ----------------------------------------------------------------------------------------
# Synthetic teacher (B-Pref)
# ----------------------------------------------------------------------------------------
def constant_pairs(returns: list[tuple[float, float]], length: int = 5) -> np.ndarray:
    """true_rewards (N, 2, L) whose segment returns are the given ones (constant per step)."""
    return np.repeat(np.asarray(returns, dtype=np.float64)[..., None] / length, length, axis=-1)


def teacher(algo, beta=-1.0, gamma=1.0, eps_mistake=0.0, eps_skip=0.0, eps_equal=0.0, seed=0):
    return SyntheticTeacher(beta, gamma, eps_mistake, eps_skip, eps_equal, seed)


def test_teacher_mistake_rate(algo):
    rng = np.random.default_rng(0)
    rewards = rng.standard_normal((20_000, 2, 4))
    rational = (rewards[:, 1].sum(-1) > rewards[:, 0].sum(-1)).astype(np.float32)
    np.testing.assert_array_equal(teacher(algo).label_true_rewards(rewards), rational)
    eps = 0.2
    labels = teacher(algo, eps_mistake=eps, seed=3).label_true_rewards(rewards)
    flip_rate = np.mean(labels != rational)
    assert abs(flip_rate - eps) < 4 * math.sqrt(eps * (1 - eps) / len(labels)), flip_rate
    assert set(np.unique(labels)) == {0.0, 1.0}


def test_teacher_skips_pairs_below_the_margin(algo):
    t = teacher(algo, eps_skip=0.5)
    t.set_margin(10.0)  # skip threshold 5
    returns = [(1.0, 2.0), (4.9, -3.0), (-10.0, -10.0), (6.0, 1.0), (1.0, 5.5), (-4.0, 8.0)]
    labels = t.label_true_rewards(constant_pairs(returns))
    skipped = np.isnan(labels)
    np.testing.assert_array_equal(skipped, [True, True, True, False, False, False])
    np.testing.assert_array_equal(labels[~skipped], [0.0, 1.0, 1.0])


def test_teacher_equal_margin_gives_ties(algo):
    # eps_mistake would flip labels; ties are decided after mistakes (B-Pref), so they stay 0.5.
    t = teacher(algo, eps_equal=0.1, eps_mistake=0.3, seed=1)
    t.set_margin(10.0)  # tie threshold 1
    returns = [(3.0, 3.5), (3.0, 2.2), (-2.0, -2.9), (3.0, 4.5), (3.0, 1.0), (0.0, 10.0)] * 200
    labels = t.label_true_rewards(constant_pairs(returns)).reshape(200, 6)
    assert np.all(labels[:, :3] == 0.5)
    assert np.all(np.isin(labels[:, 3:], [0.0, 1.0]))
    # Without mistakes the non-ties are the rational labels.
    t = teacher(algo, eps_equal=0.1)
    t.set_margin(10.0)
    np.testing.assert_array_equal(t.label_true_rewards(constant_pairs(returns[:6])), [0.5, 0.5, 0.5, 1.0, 0.0, 1.0])
    # Skip beats tie.
    t = teacher(algo, eps_skip=0.5, eps_equal=0.1)
    t.set_margin(10.0)
    assert np.isnan(t.label_true_rewards(constant_pairs([(0.1, 0.2)]))[0])


def test_teacher_bradley_terry_is_stochastic_with_the_right_frequency(algo):
    n, beta = 20_000, 2.0
    diffs = [0.5, -0.25, 1.5]
    rewards = np.zeros((n * len(diffs), 2, 1))
    rewards[:, 1, 0] = np.repeat(diffs, n)
    t = teacher(algo, beta=beta, seed=7)
    labels = t.label_true_rewards(rewards).reshape(len(diffs), n)
    for diff, group in zip(diffs, labels):
        p = 1 / (1 + math.exp(-beta * diff))
        assert abs(group.mean() - p) < 4 * math.sqrt(p * (1 - p) / n), (diff, group.mean(), p)
    again = t.label_true_rewards(rewards[:200])
    assert not np.array_equal(again, t.label_true_rewards(rewards[:200]))  # same inputs, new draws


def test_a_perfect_teacher_calls_two_segments_worth_the_same_a_tie_not_a_preference_for_the_first(algo):
    """A sparse objective (the backflip's reward is 0 while the torso is low) scores most pairs 0 against 0. The
    teacher must not prefer segment 0 there: half of a backflip run's labels were such pairs, every one saying "the
    first", a preference the reward model can only memorise. Mistakes leave a tie a tie; β-rational teachers still
    draw (p = 1/2), and pairs that differ, however little, keep their side."""
    returns = [(0.0, 0.0), (0.0, 1e-6), (2.0, 2.0), (-1.0, -1.0), (3.0, 0.5)]
    np.testing.assert_array_equal(teacher(algo).label_true_rewards(constant_pairs(returns)), [0.5, 1.0, 0.5, 0.5, 0.0])
    mistaken = teacher(algo, eps_mistake=0.5, seed=2).label_true_rewards(constant_pairs([(0.0, 0.0)] * 200))
    assert np.all(mistaken == 0.5)
    drawn = teacher(algo, beta=1.0, seed=3).label_true_rewards(constant_pairs([(0.0, 0.0)] * 4000))
    assert set(np.unique(drawn)) == {0.0, 1.0} and abs(drawn.mean() - 0.5) < 0.05


def test_teacher_rational_is_deterministic(algo):
    rng = np.random.default_rng(4)
    rewards = rng.standard_normal((500, 2, 6))
    t = teacher(algo, beta=-1.0, seed=11)
    first = t.label_true_rewards(rewards)
    np.testing.assert_array_equal(first, t.label_true_rewards(rewards))
    np.testing.assert_array_equal(first, (rewards[:, 1].sum(-1) > rewards[:, 0].sum(-1)).astype(np.float32))


def test_teacher_myopic_gamma_prefers_recent_reward(algo):
    early, late = [2.0, 0, 0, 0, 0], [0, 0, 0, 0, 2.0]
    late_second = np.array([[early, late]])  # segment 1 has its reward last
    late_first = np.array([[late, early]])
    myopic = teacher(algo, gamma=0.8)
    assert myopic.label_true_rewards(late_second)[0] == 1.0
    assert myopic.label_true_rewards(late_first)[0] == 0.0
    # gamma = 1: equal returns, the content does not decide: a tie both ways.
    farsighted = teacher(algo, gamma=1.0)
    assert farsighted.label_true_rewards(late_second)[0] == farsighted.label_true_rewards(late_first)[0] == 0.5
    # The tie margin is on undiscounted returns (B-Pref): a tie even for the myopic teacher.
    myopic_ties = teacher(algo, gamma=0.8, eps_equal=0.1)
    myopic_ties.set_margin(10.0)
    assert myopic_ties.label_true_rewards(late_second)[0] == 0.5
    # A smaller late reward beats a larger early one when gamma is small enough: 0.8^4 * 2 < 1.5.
    assert myopic.label_true_rewards(np.array([[early, [0, 0, 0, 0, 1.5]]]))[0] == 1.0
    assert farsighted.label_true_rewards(np.array([[early, [0, 0, 0, 0, 1.5]]]))[0] == 0.0


def test_teacher_seed_reproducibility(algo):
    rng = np.random.default_rng(5)
    rewards = rng.standard_normal((1000, 2, 5))

    def labels(seed):
        t = teacher(algo, beta=1.0, eps_mistake=0.3, seed=seed)
        return np.concatenate([t.label_true_rewards(rewards), t.label_true_rewards(rewards)])

    np.testing.assert_array_equal(labels(3), labels(3))
    assert not np.array_equal(labels(3), labels(4))


# ----------------------------------------------------------------------------------------
# Query samplers
# ----------------------------------------------------------------------------------------
def test_disagreement_and_entropy_scores_on_planted_probabilities(algo):
    probs = torch.tensor(
        [
            [0.5, 0.1, 0.99, 0.7],
            [0.5, 0.9, 0.99, 0.7],
            [0.5, 0.5, 0.99, 0.1],
        ]
    )
    disagreement = algo.disagreement_scores(probs)
    expected = [0.0, math.sqrt((0.4**2 + 0.4**2 + 0.0) / 3), 0.0, math.sqrt((0.2**2 + 0.2**2 + 0.4**2) / 3)]
    torch.testing.assert_close(disagreement, torch.tensor(expected), atol=1e-6, rtol=0)
    entropy = algo.entropy_scores(probs)

    def h(p):
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    torch.testing.assert_close(entropy, torch.tensor([math.log(2), math.log(2), h(0.99), h(0.5)]), atol=1e-5, rtol=0)
    # Certain pairs (p = 0 or 1) have finite, near-zero entropy.
    certain = algo.entropy_scores(torch.tensor([[0.0, 1.0]]))
    assert torch.isfinite(certain).all() and certain.max() < 1e-5


SAMPLER_EPISODE = 40


def sampler_buffer(algo, x0: np.ndarray, x1: np.ndarray, capacity: int = 500):
    """A replay buffer with obs (x0, x1), action 0, in episodes of SAMPLER_EPISODE steps."""
    rb = algo.ReplayBuffer(capacity, 2, 1, 1)
    for i in range(len(x0)):
        obs = np.array([x0[i], x1[i]], dtype=np.float32)
        rb.add(obs, obs, np.zeros(1), 0.0, 0.0, i // SAMPLER_EPISODE, np.zeros(1))
    return rb


def linear_ensemble(algo, weights: list[list[float]]):
    """A real RewardEnsemble without hidden layers: member e's reward is tanh(w_e . (x0, x1, action))."""
    model = algo.RewardEnsemble(3, ensemble_size=len(weights), hidden_dim=8, hidden_layers=0)
    with torch.no_grad():
        model.net[-1].weight.copy_(torch.tensor(weights, dtype=torch.float32)[..., None])
        model.net[-1].bias.zero_()
    return model


def _pair_keys(idx: np.ndarray) -> set:
    return {(int(a), int(b)) for a, b in idx[:, :, 0]}


def test_select_queries_disagree_finds_disputed_pairs(algo):
    rng = np.random.default_rng(0)
    n = 400  # transitions in a buffer of capacity 500; the features are laid out per slot
    hot = np.isin(np.arange(500) // SAMPLER_EPISODE, [2, 7])  # the only steps where members disagree
    rb = sampler_buffer(algo, hot[:n].astype(np.float32), rng.uniform(-1, 1, n))
    # Members weigh x1 alike and x0 with opposite signs (member 3 ignores it).
    model = linear_ensemble(algo, [[2.0, 1.0, 0.0], [-2.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    num_queries, length, factor = 5, 10, 10
    idx, mask = algo.select_queries("disagree", model, rb, num_queries, length, factor, np.random.default_rng(3), CPU)
    assert idx.shape == (num_queries, 2, length) and mask.shape == (num_queries, 2, length)

    # The candidate pool that the sampler drew (same generator state).
    pool_idx, pool_mask = rb.sample_segment_pairs(num_queries * factor, length, np.random.default_rng(3))
    pool_hot = (hot[pool_idx] & pool_mask).any(axis=(1, 2))
    assert num_queries <= pool_hot.sum() < len(pool_hot)  # a random choice would pick calm pairs
    selected_hot = (hot[idx] & mask).any(axis=(1, 2))
    assert selected_hot.all()
    assert _pair_keys(idx) <= _pair_keys(pool_idx[pool_hot])

    # And they are the top of the pool by the std of the members' preference, computed in numpy.
    w = np.array([[2.0, 1.0], [-2.0, 1.0], [0.0, 1.0]])
    x = np.stack([hot[pool_idx], rb.obs[pool_idx, 1]], axis=-1)  # (P, 2, L, 2)
    returns = (np.tanh(np.einsum("pslf,ef->epsl", x, w)) * pool_mask).sum(-1)
    p = 1 / (1 + np.exp(-(returns[..., 1] - returns[..., 0])))
    top = np.argsort(-p.std(0))[:num_queries]
    assert _pair_keys(idx) == _pair_keys(pool_idx[top])
    assert model.training  # restored for training


def test_select_queries_entropy_finds_near_boundary_pairs(algo):
    rng = np.random.default_rng(1)
    n = 400  # transitions in a buffer of capacity 500; the features are laid out per slot
    flat = np.isin(np.arange(500) // SAMPLER_EPISODE, [0, 3, 5, 8])  # reward exactly 0 there
    x1 = np.where(flat, 0.0, rng.uniform(1.0, 3.0, 500))  # elsewhere reward in (0.76, 1)
    rb = sampler_buffer(algo, np.zeros(n), x1[:n])
    model = linear_ensemble(algo, [[0.0, 1.0, 0.0]] * 3)
    num_queries, length, factor = 5, 10, 10
    idx, mask = algo.select_queries("entropy", model, rb, num_queries, length, factor, np.random.default_rng(5), CPU)
    pool_idx, pool_mask = rb.sample_segment_pairs(num_queries * factor, length, np.random.default_rng(5))
    # Pairs of two flat segments have equal returns: P = 0.5, the decision boundary.
    pool_flat = (flat[pool_idx] | ~pool_mask).all(axis=(1, 2))
    assert num_queries <= pool_flat.sum() < len(pool_flat)
    assert (flat[idx] | ~mask).all()
    assert _pair_keys(idx) <= _pair_keys(pool_idx[pool_flat])
    # The planted pairs are at the boundary, the rest of the pool is not.
    returns = (np.tanh(x1[pool_idx]) * pool_mask).sum(-1)
    gap = np.abs(returns[:, 1] - returns[:, 0])
    assert gap[pool_flat].max() == 0 and gap[~pool_flat].min() > 0


def test_select_queries_uniform_covers_the_pool(algo):
    n, length, num_queries = 300, 10, 50
    rb = sampler_buffer(algo, np.zeros(n), np.zeros(n), capacity=500)  # not full: only [0, 300) is valid
    model = linear_ensemble(algo, [[0.0, 1.0, 0.0]] * 2)
    rng = np.random.default_rng(0)
    counts = np.zeros(rb.capacity, dtype=int)
    calls = 200
    for _ in range(calls):
        idx, mask = algo.select_queries("uniform", model, rb, num_queries, length, 10, rng, CPU)
        assert idx.shape == (num_queries, 2, length)
        starts = idx[:, :, 0]
        assert (starts[:, 0] != starts[:, 1]).all()
        expected_idx, expected_mask = rb.segment_indices(starts, length)
        np.testing.assert_array_equal(idx, expected_idx)
        np.testing.assert_array_equal(mask, expected_mask)
        np.add.at(counts, starts.ravel(), 1)
    # Uniform over the starts of whole segments: none cut by an episode's time limit or the newest step.
    good = np.zeros(rb.capacity, dtype=bool)
    good[:n] = rb.whole_segments(np.arange(n), length)
    assert 0 < good.sum() < n
    assert counts[~good].sum() == 0
    assert (counts[good] > 0).all()
    expected = calls * num_queries * 2 / good.sum()
    chi2 = ((counts[good] - expected) ** 2 / expected).sum()
    assert chi2 < (good.sum() - 1) + 6 * math.sqrt(2 * (good.sum() - 1)), chi2  # df + 6 sd


# ----------------------------------------------------------------------------------------
# Feedback schedule
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("total", [1, 7, 100, 250, 1000, 1003])
@pytest.mark.parametrize("per_session", [1, 3, 10, 100, 128])
@pytest.mark.parametrize("decay", [0.5, 0.8, 0.95, 1.0])
def test_feedback_schedule(algo, total, per_session, decay):
    sessions = math.ceil(total / per_session)
    linear = algo.feedback_schedule(total, per_session, "linear", decay)
    assert sum(linear) == total and min(linear) > 0
    assert len(linear) == sessions
    assert max(linear) - min(linear) <= 1

    exponential = algo.feedback_schedule(total, per_session, "exponential", decay)
    assert sum(exponential) == total and min(exponential) > 0
    assert len(exponential) <= sessions
    assert all(a >= b for a, b in zip(exponential, exponential[1:]))
    # Consecutive sessions keep the ratio `decay`, up to rounding of both.
    assert all(abs(b - decay * a) < 1 + decay for a, b in zip(exponential, exponential[1:]))
    shares = total * decay ** np.arange(sessions) / (decay ** np.arange(sessions)).sum()
    if len(exponential) >= 2 and shares[0] - shares[len(exponential) - 1] >= 2:
        assert exponential[0] > exponential[-1]
    if decay == 1.0:
        assert exponential == linear


def test_feedback_schedule_known_values(algo):
    assert algo.feedback_schedule(0, 100, "exponential") == []
    assert algo.feedback_schedule(250, 100, "linear") == [84, 83, 83]
    default = algo.feedback_schedule(1000, 100, "exponential", 0.8)
    # shares 1000 * 0.8^i / sum_{j<10} 0.8^j: 224.06, 179.25, ..., 30.07
    assert len(default) == 10 and sum(default) == 1000
    assert default[0] in (224, 225) and default[-1] in (30, 31)
    assert default[0] > default[-1]


# ----------------------------------------------------------------------------------------
# SURF
# ----------------------------------------------------------------------------------------
def crop_masks(algo, shape: tuple, length: int, min_offset: int, max_offset: int) -> torch.Tensor:
    """SURF's crops of whole segments (crop_segments without cutting them out), as boolean masks (*shape, length)."""
    _, masks = algo.crop_segments(torch.zeros(*shape, length, 1), torch.ones(*shape, length), min_offset, max_offset, cut_out=False)
    return masks.bool()


def test_temporal_crops(algo):
    length, min_offset, max_offset = 20, 2, 7
    torch.manual_seed(0)
    masks = crop_masks(algo, (500, 2), length, min_offset, max_offset)
    assert masks.shape == (500, 2, length) and masks.dtype == torch.bool
    m = masks.reshape(-1, length).numpy().astype(int)
    kept = m.sum(-1)
    assert kept.min() >= length - max_offset and kept.max() <= length - min_offset
    assert set(kept) == set(range(length - max_offset, length - min_offset + 1))  # every length occurs
    assert (m.reshape(500, 2, length).sum(-1)[:, 0] == m.reshape(500, 2, length).sum(-1)[:, 1]).all()  # a pair shares its length
    assert (m.reshape(500, 2, length).argmax(-1)[:, 0] != m.reshape(500, 2, length).argmax(-1)[:, 1]).any()  # starts are independent
    # Contiguous: exactly one run of ones.
    padded = np.pad(m, ((0, 0), (1, 1)))
    assert ((np.diff(padded, axis=-1) == 1).sum(-1) == 1).all()
    first = m.argmax(-1)
    last = first + kept - 1
    assert first.min() == 0 and last.max() == length - 1  # windows reach both ends
    assert (last < length).all()
    # Same seed, same crops.
    torch.manual_seed(0)
    assert torch.equal(masks, crop_masks(algo, (500, 2), length, min_offset, max_offset))


def test_crop_segments_compute_only_the_window_and_give_the_masked_returns(algo):
    length, min_offset, max_offset = 20, 2, 7
    model = algo.RewardEnsemble(4, ensemble_size=3, hidden_dim=16, hidden_layers=2)
    segments = torch.randn(3, 300, 2, length, 4)  # (members, pairs, 2, L, D), as train_reward_model's batches
    masks = (torch.rand(3, 300, 2, length) < 0.9).float()
    torch.manual_seed(5)
    _, cropped_masks = algo.crop_segments(segments, masks, min_offset, max_offset, cut_out=False)
    masked_returns = (model.forward_members(segments) * cropped_masks).sum(-1)
    torch.manual_seed(5)  # the same draws
    windows, window_masks = algo.crop_segments(segments, masks, min_offset, max_offset)
    assert windows.shape == (3, 300, 2, length - min_offset, 4)  # the steps outside a window are never computed
    torch.testing.assert_close((model.forward_members(windows) * window_masks).sum(-1), masked_returns, rtol=1e-5, atol=1e-5)
    assert window_masks.sum() == cropped_masks.sum()  # every cropped step is inside its window


def test_pseudo_labels_threshold_both_sides(algo):
    tau = 0.9
    probs = torch.tensor(
        [
            [0.95, 0.05, 0.7, 0.3, 0.99, 0.85],
            [0.93, 0.02, 0.7, 0.3, 0.85, 0.99],
        ]
    )  # means: 0.94, 0.035, 0.7, 0.3, 0.92, 0.92
    labels, confident = algo.pseudo_labels(probs, tau)
    np.testing.assert_array_equal(confident.numpy(), [True, True, False, False, True, True])
    np.testing.assert_array_equal(labels[confident].numpy(), [1.0, 0.0, 1.0, 1.0])


# ----------------------------------------------------------------------------------------
# RUNE
# ----------------------------------------------------------------------------------------
def test_rune_beta(algo):
    beta0, decay = 0.05, 0.001
    values = [algo.rune_beta(beta0, decay, t) for t in (0, 1, 10, 1000, 10_000)]
    for t, value in zip((0, 1, 10, 1000, 10_000), values):
        assert value == pytest.approx(beta0 * (1 - decay) ** t, rel=1e-12)
    assert values[0] == beta0
    assert all(a > b for a, b in zip(values, values[1:]))
    assert algo.rune_beta(beta0, 0.0, 10_000) == beta0


def test_relabel_replay_buffer_writes_ensemble_mean_and_std(algo, monkeypatch):
    monkeypatch.setattr(algo, "RELABEL_CHUNK", 64)  # 1000 is not a multiple of 64
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    rb = algo.ReplayBuffer(1000, OBS_DIM, ACTION_DIM, 1)
    for i in range(1300):  # wrapped: every slot is in use
        x = rng.standard_normal(INPUT_DIM).astype(np.float32)
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], 0.0, 0.0, i // 50, np.zeros(1))
    assert rb.full
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=4, hidden_dim=32, hidden_layers=2, dropout=0.5)
    model.train()
    algo.relabel_replay_buffer(model, rb, CPU)
    assert model.training
    mean, std = rb.learned_rewards.copy(), rb.reward_std.copy()

    model.eval()
    with torch.no_grad():
        members = model(torch.as_tensor(rb.obs_actions(np.arange(rb.capacity)))).numpy()  # (E, N)
    model.train()
    np.testing.assert_allclose(mean, members.mean(0), atol=1e-6)
    np.testing.assert_allclose(std, members.std(0), atol=1e-6)
    assert std.min() > 0 and np.abs(mean).max() > 0
    predicted_mean, predicted_std = algo.predict_rewards(model, torch.as_tensor(rb.obs_actions(np.arange(rb.capacity))))
    assert model.training
    np.testing.assert_allclose(mean, predicted_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(std, predicted_std.numpy(), atol=1e-6)

    # Dropout in train mode must not leak into the labels: relabelling again gives identical arrays.
    monkeypatch.setattr(algo, "RELABEL_CHUNK", 1000)
    algo.relabel_replay_buffer(model, rb, CPU)
    np.testing.assert_array_equal(rb.learned_rewards, mean)
    np.testing.assert_array_equal(rb.reward_std, std)
    # Sanity: train-mode forward passes would differ (the dropout is real).
    x = torch.as_tensor(rb.obs_actions(np.arange(10)))
    assert not torch.equal(model(x), model(x))


def test_relabel_only_touches_stored_transitions(algo, monkeypatch):
    monkeypatch.setattr(algo, "RELABEL_CHUNK", 7)
    torch.manual_seed(4)
    rb = algo.ReplayBuffer(100, OBS_DIM, ACTION_DIM, 1)
    for i in range(30):
        x = np.full(INPUT_DIM, i / 30, dtype=np.float32)
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], 0.0, 0.0, 0, np.zeros(1))
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=2, hidden_dim=8, hidden_layers=1)
    algo.relabel_replay_buffer(model, rb, CPU)
    assert np.all(rb.learned_rewards[30:] == 0) and np.all(rb.reward_std[30:] == 0)
    expected, _ = algo.predict_rewards(model, torch.as_tensor(rb.obs_actions(np.arange(30))))
    np.testing.assert_allclose(rb.learned_rewards[:30], expected.numpy(), atol=1e-6)


# ----------------------------------------------------------------------------------------
# Unsupervised exploration: k-NN state entropy
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 10])
def test_knn_state_entropy_matches_brute_force(algo, k):
    rng = np.random.default_rng(k)
    states = rng.standard_normal((60, 5))
    reference = rng.standard_normal((300, 5))
    brute = np.sort(np.sqrt(((states[:, None, :] - reference[None, :, :]) ** 2).sum(-1)), axis=1)[:, k - 1]
    got = algo.knn_state_entropy(torch.as_tensor(states), torch.as_tensor(reference), k).numpy()
    np.testing.assert_allclose(got, brute, rtol=1e-6, atol=1e-6)
    got32 = algo.knn_state_entropy(torch.as_tensor(states, dtype=torch.float32), torch.as_tensor(reference, dtype=torch.float32), k)
    np.testing.assert_allclose(got32.numpy(), brute, rtol=1e-3, atol=1e-3)


def test_knn_state_entropy_counts_the_state_itself(algo):
    # States that are part of the reference set are their own nearest neighbour (distance 0).
    reference = torch.tensor([[0.0], [1.0], [3.0], [7.0]], dtype=torch.float64)
    np.testing.assert_allclose(algo.knn_state_entropy(reference, reference, 1).numpy(), [0, 0, 0, 0])
    np.testing.assert_allclose(algo.knn_state_entropy(reference, reference, 2).numpy(), [1, 1, 2, 4])


# ----------------------------------------------------------------------------------------
# Held-out accuracy on fresh oracle-labelled pairs (a synthetic teacher spends no label on checking)
# ----------------------------------------------------------------------------------------
def linear_reward_model(algo, weights: list[float]):
    """A real RewardEnsemble with no hidden layer: r(x) = tanh(w . x), so its preferences are known."""
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=2, hidden_layers=0)
    with torch.no_grad():
        for layer in model.net:
            layer.weight.copy_(torch.tensor(weights, dtype=torch.float32)[None, :, None].expand_as(layer.weight))
            layer.bias.zero_()
    return model


def test_fresh_pair_accuracy_measures_agreement_with_the_true_reward(algo):
    rb = random_replay_buffer(algo, np.random.default_rng(0))
    aligned = linear_reward_model(algo, [1.0, -0.5, 0.0, 0.0])  # the true step reward exactly
    opposed = linear_reward_model(algo, [-1.0, 0.5, 0.0, 0.0])
    blind = linear_reward_model(algo, [0.0, 0.0, 1.0, 0.0])  # looks at a feature the reward ignores
    accuracy = {
        name: fresh_pair_accuracy(
            functools.partial(algo.preference_probabilities, model), rb, rb.true_rewards, 400, SEG_LEN, np.random.default_rng(1), CPU
        )
        for name, model in (("aligned", aligned), ("opposed", opposed), ("blind", blind))
    }
    assert accuracy["aligned"] == 1.0 and accuracy["opposed"] == 0.0
    assert 0.35 < accuracy["blind"] < 0.65, accuracy


def test_synthetic_labels_all_train_and_heldout_accuracy_comes_from_fresh_pairs(algo):
    rb = random_replay_buffer(algo, np.random.default_rng(0))
    prefs = algo.PreferenceBuffer(SEG_LEN, INPUT_DIM, 1)
    model = linear_reward_model(algo, [1.0, -0.5, 0.0, 0.0])
    args = algo.Args(segment_length=SEG_LEN)
    assert SyntheticTeacher.labels_are_free
    fresh = algo.reward_model_metrics(model, prefs, rb, args, True, 500, CPU)
    assert fresh["heldout_accuracy"] == 1.0  # no held-out label exists: measured on fresh pairs
    again = algo.reward_model_metrics(model, prefs, rb, args, True, 500, CPU)
    assert again["heldout_accuracy"] == fresh["heldout_accuracy"]  # seeded by the step, not the run's rng
    assert math.isnan(algo.reward_model_metrics(model, prefs, rb, args, False, 500, CPU)["heldout_accuracy"])


def model_reward_objective(obs, actions, states):
    """A --teacher-objective (loaded as test_components:model_reward_objective) that is the known step reward."""
    return np.tanh(obs[..., 0] - 0.5 * obs[..., 1])


def test_with_an_objective_the_reward_model_is_measured_against_the_objective_not_the_env(algo):
    """A run on --teacher-objective learns the objective, so its accuracy and correlations must be measured against
    it: here the env's own reward is the objective's opposite, and a model that learned the objective exactly must
    score 1.0, where measured against the env it scores 0 (and on the zero-reward windmill, nothing at all)."""
    rng = np.random.default_rng(0)
    rb = algo.ReplayBuffer(1000, OBS_DIM, ACTION_DIM, 1)
    for i, x in enumerate(rng.standard_normal((1000, INPUT_DIM)).astype(np.float32)):
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], -true_step_reward(x), 0.0, i // 100, np.zeros(1))
    model = linear_reward_model(algo, [1.0, -0.5, 0.0, 0.0])  # the objective exactly
    rb.learned_rewards[: rb.size] = true_step_reward(np.concatenate([rb.obs, rb.actions], -1))[: rb.size]
    prefs = algo.PreferenceBuffer(SEG_LEN, INPUT_DIM, 1)
    env_args = algo.Args(segment_length=SEG_LEN)
    objective_args = algo.Args(segment_length=SEG_LEN, teacher_objective="test_components:model_reward_objective")
    against_env = algo.reward_model_metrics(model, prefs, rb, env_args, True, 500, CPU)
    against_objective = algo.reward_model_metrics(model, prefs, rb, objective_args, True, 500, CPU)
    assert against_env["heldout_accuracy"] == 0.0 and against_env["reward_correlation"] == pytest.approx(-1.0)
    assert against_objective["heldout_accuracy"] == 1.0
    assert against_objective["reward_correlation"] == pytest.approx(1.0)
    assert against_objective["segment_correlation"] == pytest.approx(1.0)
    assert against_objective["true_reward_mean"] == pytest.approx(-against_env["true_reward_mean"], abs=1e-6)
    np.testing.assert_array_equal(rb.true_rewards[: rb.size], -rb.learned_rewards[: rb.size])  # the buffer is untouched


# ----------------------------------------------------------------------------------------
# QPA: policy-aligned queries, hybrid experience replay, cropped copies of labelled pairs
# ----------------------------------------------------------------------------------------
def test_policy_aligned_queries_come_from_the_last_episodes_only(algo):
    rb = random_replay_buffer(algo, np.random.default_rng(0), n=1000, episode_length=50)  # episodes 0..19
    model = algo.RewardEnsemble(INPUT_DIM)
    for strategy in ("uniform", "disagree"):
        idx, mask = algo.select_queries(strategy, model, rb, 200, SEG_LEN, 5, np.random.default_rng(1), CPU, recent=3)
        assert set(np.unique(rb.episode_ids[idx[..., 0]])) == {17, 18, 19}
        assert (rb.episode_ids[idx][mask] >= 17).all()
    idx, _ = algo.select_queries("uniform", model, rb, 200, SEG_LEN, 5, np.random.default_rng(1), CPU)
    assert len(np.unique(rb.episode_ids[idx[..., 0]])) > 15  # without QPA: the whole buffer


def test_hybrid_replay_mixes_exactly_the_asked_share_of_recent_slots(algo):
    rb = random_replay_buffer(algo, np.random.default_rng(0), n=1000, episode_length=50)
    recent = rb.recent_episode_slots(2)
    np.testing.assert_array_equal(recent, np.arange(900, 1000))
    idx = rb.sample_indices(256, np.random.default_rng(2), recent, 0.5)
    assert len(idx) == 256 and np.isin(idx[:128], recent).all()
    assert not np.isin(idx[128:], recent).all()  # the rest is uniform over the whole buffer
    np.testing.assert_array_equal(
        rb.sample_indices(256, np.random.default_rng(2)), rb.sample_indices(256, np.random.default_rng(2), recent, 0.0)
    )


def test_qpa_augmentation_trains_every_pair_with_its_cropped_copies(algo):
    rng = np.random.default_rng(0)
    segments = random_pairs(rng, 40)
    prefs = preference_buffer(algo, segments, (true_step_reward(segments).sum(-1).argmax(-1)).astype(np.float32), heldout=False)
    rb = random_replay_buffer(algo, rng)
    steps = {}
    for copies in (0, 4):
        torch.manual_seed(0)
        model = algo.RewardEnsemble(INPUT_DIM, hidden_dim=16)
        args = algo.Args(
            segment_length=SEG_LEN, max_augmentation_offset=2, min_augmentation_offset=1, surf=False,
            reward_net_epochs=1, reward_net_batch_size=16, qpa_augmentations=copies,
        )  # fmt: skip
        stats = algo.train_reward_model(model, torch.optim.Adam(model.parameters()), prefs, rb, args, rng, CPU)
        steps[copies] = stats["steps"]
    assert steps == {0: 3, 4: math.ceil(40 * 5 / 16)}


def test_qpa_settings_are_checked():
    with pytest.raises(sac_rlhf.ConfigError, match="--qpa-hybrid-ratio 0.5 needs --qpa-query-episodes"):
        sac_rlhf.validate_args(sac_rlhf.Args(qpa_hybrid_ratio=0.5))
    sac_rlhf.validate_args(sac_rlhf.Args(qpa_hybrid_ratio=0.5, qpa_query_episodes=10, qpa_augmentations=20))
    assert not hasattr(pref_ppo.Args(), "qpa_hybrid_ratio")  # PPO learns from its own rollouts: it mixes no replay
