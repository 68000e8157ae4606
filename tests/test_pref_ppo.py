"""PrefPPO (pref_ppo.py) and its true-reward baseline ppo.py: PPO's own pieces checked against values computed
by hand or independently (GAE, the rollout's learned rewards, observation normalisation), real rollouts on
CartPole-v1, end-to-end runs on CartPole-v1 and Hopper-v5, exact resume, bad input. The components copied from
sac_rlhf.py (reward model, teacher, samplers, SURF, RUNE, k-NN) are checked by test_components.py."""

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_end_to_end import final_state, scalars

import ppo
import pref_ppo
from cleanrlhf_utils.envs import set_physics_state
from cleanrlhf_utils.evaluate import evaluate_policy
from cleanrlhf_utils.feedback import CHOICE_LABELS
from cleanrlhf_utils.training import NormalizedPolicy

CPU = torch.device("cpu")
REPO_ROOT = Path(__file__).resolve().parents[1]
RANDOM_CARTPOLE_RETURN = 22  # mean return of uniformly random actions on CartPole-v1


# ----------------------------------------------------------------------------------------
# GAE with next-step autoreset
# ----------------------------------------------------------------------------------------
def gae_by_definition(rewards, values, next_values, terminated, truncated, valid, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} over the rest of t's episode, written out as a double loop."""
    T = len(rewards)
    advantages = np.zeros(T)
    for t in range(T):
        if not valid[t]:
            continue
        total, weight = 0.0, 1.0
        for u in range(t, T):
            total += weight * (rewards[u] + gamma * next_values[u] * (1 - terminated[u]) - values[u])
            if terminated[u] or truncated[u]:
                break
            weight *= gamma * lam
        advantages[t] = total
    return advantages


def test_gae_matches_hand_computation():
    gamma, lam = 0.9, 0.8
    # Env 0: a step, a terminated step, its autoreset step, a step, a truncated step, its autoreset step.
    # next_values: V(obs[t+1]) within an episode; V(final obs) at the episode end (0.9 at t=1 must be ignored:
    # terminated; 0.8 at t=4 is bootstrapped: truncated); the autoreset steps' values are never used.
    # Env 1: the rollout starts on an autoreset step, no episode end after it: the last step bootstraps (1.0).
    # Env 2: no episode end at all.
    rewards = np.array([[1, 0, 0], [2, 1, 1], [0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]], dtype=np.float32)
    values = np.array(
        [[0.5, 7, 0.1], [0.6, 0.2, 0.2], [0.9, 0.3, 0.3], [0.3, 0.4, 0.4], [0.4, 0.5, 0.5], [0.8, 0.6, 0.6]], dtype=np.float32
    )
    next_values = np.array(
        [[0.6, 0.2, 0.2], [0.9, 0.3, 0.3], [0.3, 0.4, 0.4], [0.4, 0.5, 0.5], [0.8, 0.6, 0.6], [0.2, 1.0, 1.0]], dtype=np.float32
    )
    terminated = np.zeros((6, 3), dtype=bool)
    truncated = np.zeros((6, 3), dtype=bool)
    valid = np.ones((6, 3), dtype=bool)
    terminated[1, 0] = truncated[4, 0] = True
    valid[2, 0] = valid[5, 0] = valid[0, 1] = False

    advantages, returns = pref_ppo.compute_gae(rewards, values, next_values, terminated, truncated, valid, gamma, lam)

    # Env 0 by hand (gamma lam = 0.72):
    a4 = 1 + 0.9 * 0.8 - 0.4  # truncated: bootstraps V(final obs), nothing after it = 1.32
    a3 = 1 + 0.9 * 0.4 - 0.3 + 0.72 * a4  # = 2.0104
    a1 = 2 - 0.6  # terminated: no bootstrap, nothing after it = 1.4
    a0 = 1 + 0.9 * 0.6 - 0.5 + 0.72 * a1  # = 2.048
    np.testing.assert_allclose(advantages[:, 0], [a0, a1, 0, a3, a4, 0], rtol=1e-6)
    assert a3 == pytest.approx(2.0104) and a0 == pytest.approx(2.048)
    np.testing.assert_allclose(returns[valid[:, 0], 0], np.array([a0, a1, a3, a4]) + values[valid[:, 0], 0], rtol=1e-6)
    # Env 1: the autoreset step gets nothing, and its value (7) does not leak into the step before (none) or after.
    assert advantages[0, 1] == 0
    np.testing.assert_allclose(advantages[1:, 1], advantages[1:, 2], rtol=1e-6)  # same data as env 2 from t=1 on
    a5 = 1 + 0.9 * 1.0 - 0.6
    np.testing.assert_allclose(advantages[5, 2], a5, rtol=1e-6)
    # Every column against the definition.
    for env in range(3):
        expected = gae_by_definition(
            rewards[:, env], values[:, env], next_values[:, env], terminated[:, env], truncated[:, env], valid[:, env], gamma, lam
        )
        np.testing.assert_allclose(advantages[:, env], expected, rtol=1e-5, atol=1e-7)


def test_return_normalizer_restarts_the_discounted_return_at_episode_ends():
    gamma = 0.5
    rewards = np.array([[1.0, 2.0], [1.0, 0.0], [1.0, 2.0], [1.0, 4.0]], dtype=np.float32)
    dones = np.array([[False, True], [True, False], [False, False], [False, False]])
    valid = np.array([[True, True], [True, False], [False, True], [True, True]])
    normalizer = pref_ppo.ReturnNormalizer(2, gamma)
    scaled = normalizer.scale(rewards, dones, valid)
    # Env 0: returns 1, 1.5 (episode end), [autoreset], 1; env 1: 2 (end), [autoreset], 2, 5.
    seen = np.array([1, 2, 1.5, 2, 1, 5], dtype=np.float64)
    moments = pref_ppo.RunningMoments()
    moments.update(seen)
    np.testing.assert_allclose(scaled, rewards / np.sqrt(moments.var + 1e-8), rtol=1e-6)
    np.testing.assert_array_equal(normalizer.returns, [1.0, 5.0])
    assert not np.array_equal(scaled, rewards)
    unscaled = pref_ppo.ReturnNormalizer(2, gamma, enabled=False).scale(rewards, dones, valid)
    np.testing.assert_array_equal(unscaled, rewards)


# ----------------------------------------------------------------------------------------
# A rollout's rewards come from the reward model (+ RUNE)
# ----------------------------------------------------------------------------------------
def filled_rollout(rng, num_steps=7, num_envs=3, obs_dim=3, action_dim=2):
    rollout = pref_ppo.RolloutBuffer(num_steps, num_envs, obs_dim, (action_dim,), action_dim, 1)
    rollout.raw_obs[:] = rng.standard_normal(rollout.raw_obs.shape)
    rollout.reward_actions[:] = rng.uniform(-1, 1, rollout.reward_actions.shape)
    rollout.valid[:] = rng.random(rollout.valid.shape) > 0.25
    rollout.true_rewards[:] = rng.standard_normal(rollout.true_rewards.shape)
    return rollout


def test_relabel_rollout_is_the_reward_model_prediction_plus_rune(monkeypatch):
    monkeypatch.setattr(pref_ppo, "RELABEL_CHUNK", 5)  # 21 steps: chunks of 5 and a remainder
    torch.manual_seed(0)
    rollout = filled_rollout(np.random.default_rng(0))
    assert (~rollout.valid).any()
    model = pref_ppo.RewardEnsemble(5, ensemble_size=4, hidden_dim=16, hidden_layers=2, dropout=0.5)
    model.train()
    beta = 0.3
    true_before = rollout.true_rewards.copy()
    pref_ppo.relabel_rollout(model, rollout, CPU, beta=beta)
    assert model.training

    model.eval()
    with torch.no_grad():
        members = model(torch.as_tensor(rollout.obs_actions())).numpy()  # (E, T, N), no dropout
    model.train()
    valid = rollout.valid
    np.testing.assert_allclose(rollout.learned_rewards[valid], members.mean(0)[valid], atol=1e-6)
    np.testing.assert_allclose(rollout.reward_std[valid], members.std(0)[valid], atol=1e-6)
    np.testing.assert_allclose(rollout.rewards[valid], (members.mean(0) + beta * members.std(0))[valid], atol=1e-6)
    assert not rollout.learned_rewards[~valid].any() and not rollout.rewards[~valid].any()  # autoreset steps: no reward
    np.testing.assert_array_equal(rollout.true_rewards, true_before)  # the true reward is never touched

    # Dropout does not leak into the rewards (eval mode): the same again, in one chunk; without RUNE, the mean only.
    rewards = rollout.rewards.copy()
    monkeypatch.setattr(pref_ppo, "RELABEL_CHUNK", 1000)
    pref_ppo.relabel_rollout(model, rollout, CPU, beta=beta)
    np.testing.assert_array_equal(rollout.rewards, rewards)
    pref_ppo.relabel_rollout(model, rollout, CPU, beta=0.0)
    np.testing.assert_array_equal(rollout.rewards, rollout.learned_rewards)


def test_discrete_actions_reach_the_reward_model_one_hot():
    space = gym.spaces.Discrete(3)
    np.testing.assert_array_equal(pref_ppo.encode_actions(np.array([[2, 0], [1, 1]]), space), np.eye(3)[[[2, 0], [1, 1]]])
    assert pref_ppo.reward_action_dim(space) == 3
    box = gym.spaces.Box(-1.0, 1.0, (2,))
    np.testing.assert_array_equal(pref_ppo.env_actions(np.array([[3.0, -0.5]]), box), [[1.0, -0.5]])  # clipped
    assert pref_ppo.reward_action_dim(box) == 2


# ----------------------------------------------------------------------------------------
# Real rollouts on CartPole: autoreset steps, the replay buffer, simulator states
# ----------------------------------------------------------------------------------------
def test_cartpole_rollout_replay_buffer_and_physics_states():
    args = pref_ppo.Args(env_id="CartPole-v1", num_envs=2, seed=3)
    envs = pref_ppo.make_vector_env(args)
    obs, _ = envs.reset(seed=args.seed)
    torch.manual_seed(0)
    agent = pref_ppo.Agent(4, envs.single_action_space)
    normalizer = pref_ppo.ObservationNormalizer(4)
    state_dim = pref_ppo.physics_state_size(envs.envs[0])
    assert state_dim == 4  # CartPole's own `state`
    rollout = pref_ppo.RolloutBuffer(150, 2, 4, (), 2, state_dim)
    episodes = pref_ppo.EpisodeTracker(2)
    rb = pref_ppo.ReplayBuffer(1000, 4, 2, state_dim)
    _, finished = pref_ppo.collect_rollout(envs, agent, normalizer, rollout, obs, episodes, CPU)
    envs.close()
    pref_ppo.add_rollout_to_buffer(rb, rollout)

    done = rollout.terminated | rollout.truncated
    assert done.sum() >= 6 and len(finished) == done.sum()  # a random policy falls within ~22 steps
    # Next-step autoreset: exactly the step after an episode end is invalid, and it is never stored.
    np.testing.assert_array_equal(~rollout.valid[1:], done[:-1])
    assert rollout.valid[0].all() and rb.size == rollout.valid.sum()
    assert not rollout.true_rewards[~rollout.valid].any()
    for _, _, episode_return, length in finished:
        assert episode_return == length  # CartPole: 1 per step
    # The replay buffer holds env 0's steps, then env 1's, consecutive in time; ids never shared between envs.
    n = rb.size
    same_episode = rb.episode_ids[1:n] == rb.episode_ids[: n - 1]
    np.testing.assert_array_equal(rb.obs[1:n][same_episode], rb.next_obs[: n - 1][same_episode])
    assert not set(rollout.episode_ids[:, 0]) & set(rollout.episode_ids[:, 1])
    np.testing.assert_array_equal(rb.actions[:n].sum(-1), 1)  # one-hot
    idx, mask = rb.sample_segment_pairs(200, 10, np.random.default_rng(0))
    assert np.all(rb.episode_ids[idx][mask] == np.broadcast_to(rb.episode_ids[idx[..., :1]], idx.shape)[mask])
    # Setting a stored simulator state into a fresh env and taking the stored action reproduces the transition.
    env = pref_ppo.make_env("CartPole-v1", 0)()
    env.reset(seed=0)
    for i in range(n):
        set_physics_state(env, rb.physics_states[i])
        np.testing.assert_array_equal(np.asarray(env.unwrapped.state, dtype=np.float32), rb.obs[i])
        next_obs, reward, terminated, _, _ = env.step(int(rb.actions[i].argmax()))
        np.testing.assert_array_equal(next_obs, rb.next_obs[i])
        assert reward == rb.true_rewards[i] and terminated == bool(rb.terminated[i])
    env.close()


# ----------------------------------------------------------------------------------------
# End to end: CartPole-v1 (discrete) learns from the oracle teacher; normalisation in checkpoints; file mode
# ----------------------------------------------------------------------------------------
CARTPOLE = {
    "env_id": "CartPole-v1",
    "num_envs": 4,
    "num_steps": 128,
    "num_minibatches": 4,
    "update_epochs": 4,
    "ent_coef": 0.01,
    "learning_rate": 2.5e-4,
    "evaluation_frequency": 0,
    "evaluation_episodes": 5,
    "progress_bar": False,
}


def cartpole_args(run_name: str, **overrides) -> pref_ppo.Args:
    args = pref_ppo.Args(
        run_name=run_name,
        total_timesteps=40_960,
        unsupervised_exploration=False,
        teacher_feedback_total_queries=160,
        teacher_feedback_num_queries_per_session=40,
        teacher_feedback_frequency=4096,
        teacher_eps_equal=0.01,  # equal segment returns (same number of steps alive) are ties, not arbitrary labels
        segment_length=25,
        max_augmentation_offset=5,
        min_augmentation_offset=2,
        reward_net_hidden_dim=64,
        checkpoint_frequency=0,
        **CARTPOLE,
    )
    return replace(args, **overrides)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cartpole")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        summary = pref_ppo.main(cartpole_args("cartpole"))
    return folder, summary


def test_cartpole_learns_from_the_oracle_teacher(cartpole_run):
    folder, summary = cartpole_run
    assert summary["labels_obtained"] == 160 and summary["feedback_sessions"] == 4
    assert summary["final_eval_return"] >= 100 > 4 * RANDOM_CARTPOLE_RETURN, summary
    checkpoint = torch.load(folder / "models/cartpole/latest/checkpoint.pt", weights_only=False)
    prefs = checkpoint["preference_buffer"]
    assert prefs["obs_actions"].shape[1:] == (2, 25, 4 + 2)  # (obs, one-hot action)
    actions = prefs["obs_actions"][..., 4:][prefs["masks"]]
    assert set(np.unique(actions)) == {0.0, 1.0} and np.all(actions.sum(-1) == 1)
    # Labels of an oracle: the segment that stays alive longer (more unmasked steps) is preferred, equal ones tie.
    alive = prefs["masks"].sum(-1)
    expected = np.where(alive[:, 1] > alive[:, 0], 1.0, np.where(alive[:, 1] < alive[:, 0], 0.0, 0.5))
    np.testing.assert_array_equal(prefs["labels"], expected)
    np.testing.assert_array_equal(prefs["true_rewards"].sum(-1), alive)  # the raw true reward (1 per step)


def test_observation_normalisation_is_saved_and_applied_by_evaluation(cartpole_run):
    folder, summary = cartpole_run
    checkpoint = torch.load(folder / "models/cartpole/latest/checkpoint.pt", weights_only=False)
    stats = checkpoint["obs_normalizer"]
    assert stats["count"] > 20_000 and np.all(stats["var"] > 0) and np.abs(stats["var"] - 1).max() > 0.5  # learned, not identity

    policy, env_id = ppo.load_policy(folder / "models/cartpole/latest")
    assert env_id == "CartPole-v1" and policy.normalize_obs
    np.testing.assert_array_equal(policy.obs_mean.numpy(), stats["mean"])
    np.testing.assert_array_equal(policy.obs_var.numpy(), stats["var"])
    # The policy normalises raw observations exactly as training did (ObservationNormalizer.normalize).
    normalizer = pref_ppo.ObservationNormalizer(4)
    normalizer.load_state_dict(stats)
    raw = np.random.default_rng(0).normal(0, [1, 1, 0.1, 1], size=(500, 4)).astype(np.float32)
    np.testing.assert_array_equal(policy.normalize(torch.as_tensor(raw)).numpy(), normalizer.normalize(raw))
    with torch.no_grad():
        actions = policy.deterministic_action(torch.as_tensor(raw))
        unnormalised = policy.agent.deterministic_action(torch.as_tensor(raw))
    assert (actions != unnormalised).any()  # the statistics matter: evaluation without them acts differently
    # Evaluating the saved policy with the run's evaluation seeds reproduces its final evaluation.
    returns = evaluate_policy(policy, env_id, 5, 1 + 100_000, CPU)
    assert np.mean(returns) == pytest.approx(summary["final_eval_return"])
    with pytest.raises(pref_ppo.ConfigError, match="no checkpoint there"):
        ppo.load_policy(folder / "models/nope/latest")


@pytest.mark.parametrize("module", ["pref_ppo", "ppo"])
def test_the_evaluation_policy_runs_where_the_agent_is(module):
    """Found on an H100: a GPU run's evaluation failed at its first observation, because the policy kept the
    observation statistics on the CPU and moved each observation there, away from the agent on the GPU. The meta
    device stands in for the GPU on a machine without one: any device but the CPU shows it."""
    import importlib

    script = importlib.import_module(module)
    space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    normalizer = script.ObservationNormalizer(3)
    normalizer.update(np.random.default_rng(0).normal(size=(10, 3)))
    policy = NormalizedPolicy(script.Agent(3, space).to("meta"), normalizer)
    assert policy.obs_mean.device.type == "meta"
    assert policy.deterministic_action(torch.zeros(1, 3)).device.type == "meta"


def test_file_mode_trains_from_the_labels_a_run_saved(cartpole_run, chdir_tmp):
    folder, _ = cartpole_run
    labels_file = folder / "runs/cartpole/labels.sqlite"
    summary = pref_ppo.main(
        cartpole_args(
            "replay", total_timesteps=4096, teacher_feedback_mode="file", feedback_file=str(labels_file), teacher_feedback_frequency=1024
        )
    )
    assert summary["labels_obtained"] == 160
    original = torch.load(folder / "models/cartpole/latest/checkpoint.pt", weights_only=False)["preference_buffer"]
    replayed = torch.load("models/replay/latest/checkpoint.pt", weights_only=False)["preference_buffer"]
    for name in ("labels", "obs_actions", "masks", "true_rewards", "physics_states"):
        np.testing.assert_array_equal(replayed[name], original[name], err_msg=name)


def test_ppo_baseline_learns_cartpole_from_the_true_reward(chdir_tmp):
    import ppo

    summary = ppo.main(ppo.Args(run_name="base", total_timesteps=30_720, **CARTPOLE))
    assert summary["final_eval_return"] >= 100 > 4 * RANDOM_CARTPOLE_RETURN, summary
    tags = scalars(Path("runs/base"))
    assert {"charts/episodic_return", "losses/value_loss", "losses/policy_loss", "losses/approx_kl", "eval/mean_return"} <= set(tags)
    policy, env_id = ppo.load_policy("models/base/latest")
    returns = evaluate_policy(policy, env_id, 5, 1 + 100_000, CPU)
    assert np.mean(returns) == pytest.approx(summary["final_eval_return"])

    # framework/evaluation.py reads PPO checkpoints too (deterministic actions, normalisation applied).
    import evaluation

    result = evaluation.main(evaluation.Args(path_to_model="models/base/latest", episodes=2, seed=7))
    assert result["env_id"] == "CartPole-v1"
    assert result["returns"] == evaluate_policy(policy, env_id, 1, 7, CPU) + evaluate_policy(policy, env_id, 1, 8, CPU)


# ----------------------------------------------------------------------------------------
# End to end on Hopper-v5: scalars, checkpoints, feedback sessions, exact resume
# ----------------------------------------------------------------------------------------
def hopper_args(run_name: str, **overrides) -> pref_ppo.Args:
    args = pref_ppo.Args(
        env_id="Hopper-v5",
        run_name=run_name,
        total_timesteps=3072,
        num_envs=2,
        num_steps=256,
        num_minibatches=4,
        update_epochs=2,
        total_explore_steps=1024,
        teacher_feedback_total_queries=30,
        teacher_feedback_num_queries_per_session=10,
        teacher_feedback_frequency=512,
        segment_length=20,
        max_augmentation_offset=5,
        min_augmentation_offset=2,
        reward_net_hidden_dim=64,
        reward_net_epochs=5,
        explore_knn_sample_size=500,
        evaluation_frequency=0,
        evaluation_episodes=1,
        checkpoint_frequency=0,
        progress_bar=False,
    )
    return replace(args, **overrides)


def test_hopper_run_writes_scalars_checkpoint_and_feedback(chdir_tmp):
    args = hopper_args("e2e", rune=True, track=True, capture_video=True, evaluation_frequency=2048, checkpoint_frequency=2048)
    summary = pref_ppo.main(args)

    tags = scalars(Path("runs/e2e"))
    for tag in [
        "charts/episodic_return",
        "charts/episodic_length",
        "charts/SPS",
        "charts/learning_rate",
        "losses/value_loss",
        "losses/policy_loss",
        "losses/entropy",
        "losses/approx_kl",
        "losses/clipfrac",
        "losses/explained_variance",
        "exploration/intrinsic_reward",
        "feedback/labels_obtained",
        "feedback/sessions",
        "reward_model/train_accuracy",
        "reward_model/heldout_accuracy",
        "reward_model/reward_correlation",
        "reward_model/pseudo_labels",
        "rune/beta",
        "eval/mean_return",
    ]:
        assert tag in tags, f"missing TensorBoard scalar {tag}"
    # Exploration: iterations ending at 512 and 1024; sessions after the rollouts ending at 1536, 2048, 2560.
    assert [s for s, _ in tags["exploration/intrinsic_reward"]] == [512, 1024]
    assert [(s, v) for s, v in tags["feedback/sessions"]] == [(1536, 1), (2048, 2), (2560, 3)]
    assert tags["feedback/labels_obtained"][-1][1] == 30 == summary["labels_obtained"]
    assert [s for s, _ in tags["eval/mean_return"]] == [2048, 3072]
    betas = [v for _, v in tags["rune/beta"]]
    assert betas == sorted(betas, reverse=True) and betas[0] > betas[-1]
    lrs = [v for _, v in tags["charts/learning_rate"]]
    assert lrs[0] == pytest.approx(3e-4) and lrs == sorted(lrs, reverse=True)  # annealed

    assert Path("models/e2e/1024/checkpoint.pt").is_file(), "exploration checkpoint"
    checkpoint = torch.load("models/e2e/latest/checkpoint.pt", weights_only=False)
    assert checkpoint["algorithm"] == "pref_ppo" and checkpoint["loop"]["global_step"] == 3072
    assert len(checkpoint["preference_buffer"]["labels"]) == 30
    assert sorted(p.name for p in Path("videos/e2e").glob("*.mp4")) == ["eval_step_2048.mp4", "eval_step_3072.mp4"]
    assert json.loads(Path("runs/e2e/summary.json").read_text())["labels_obtained"] == 30
    assert any(Path("runs/e2e/wandb").glob("offline-run-*")), "W&B offline run"

    rb = pref_ppo.ReplayBuffer(3072, 11, 3, checkpoint["preference_buffer"]["physics_states"].shape[-1])
    rb.load("models/e2e/latest/replay_buffer.npz")
    n = rb.size
    # One autoreset step (not stored) after every episode end, except ends at the last step of an env (2 envs).
    ends = int(rb.terminated[:n].sum())
    assert ends - 2 <= 3072 - n <= ends and ends >= 10
    # Every stored transition carries the final reward model's prediction: the buffer was relabelled at the last
    # session and later rollouts were predicted by the same model.
    model = pref_ppo.RewardEnsemble(14, 3, 64, 3)
    model.load_state_dict(checkpoint["reward_model"])
    mean, std = pref_ppo.predict_rewards(model, torch.as_tensor(rb.obs_actions(np.arange(n))))
    np.testing.assert_allclose(rb.learned_rewards[:n], mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(rb.reward_std[:n], std.numpy(), atol=1e-6)
    # The stored true rewards are the environment's raw ones (reward normalisation is for PPO only).
    env = pref_ppo.make_env("Hopper-v5", 0)()
    env.reset(seed=0)
    for i in range(0, n, 61):
        set_physics_state(env, rb.physics_states[i])
        _, reward, _, _, _ = env.step(rb.actions[i])
        assert reward == pytest.approx(float(rb.true_rewards[i]), abs=1e-5)
    env.close()


def assert_same_training(a: dict, b: dict) -> None:
    for part in ("agent", "reward_model"):
        for name, value in a["checkpoint"][part].items():
            assert torch.equal(value, b["checkpoint"][part][name]), f"{part}.{name} differs"
    for name in ("labels", "obs_actions", "physics_states"):
        np.testing.assert_array_equal(a["checkpoint"]["preference_buffer"][name], b["checkpoint"]["preference_buffer"][name])
    for name in ("obs", "actions", "true_rewards", "learned_rewards", "physics_states", "episode_ids"):
        np.testing.assert_array_equal(a["replay"][name], b["replay"][name])
    for part in ("obs_normalizer", "return_normalizer", "episodes"):
        assert json.dumps(a["checkpoint"][part], default=np.ndarray.tolist) == json.dumps(b["checkpoint"][part], default=np.ndarray.tolist)
    loop_a, loop_b = a["checkpoint"]["loop"], b["checkpoint"]["loop"]
    for key in ("global_step", "iteration", "labels_obtained", "sessions_done", "learning_from_preferences"):
        assert loop_a[key] == loop_b[key], key
    assert a["checkpoint"]["rng"] == b["checkpoint"]["rng"]
    assert torch.equal(a["checkpoint"]["torch_rng"], b["checkpoint"]["torch_rng"])


def test_interrupt_resume_and_exploration_from_continue_exactly(chdir_tmp, monkeypatch):
    pref_ppo.main(hopper_args("whole"))
    uninterrupted = final_state("whole")

    # Ctrl-C in the middle of the 4th rollout (vector step 900 of 1536), after the first feedback session.
    calls, real_step = [0], gym.vector.SyncVectorEnv.step

    def step(self, actions):
        calls[0] += 1
        if calls[0] == 900:
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", step)
    with pytest.raises(KeyboardInterrupt):
        pref_ppo.main(hopper_args("part"))
    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", real_step)
    part = final_state("part")["checkpoint"]
    assert part["loop"]["global_step"] == 1536 and part["loop"]["sessions_done"] == 1  # the rollout's start
    assert json.loads(Path("runs/part/summary.json").read_text())["interrupted"]
    pref_ppo.main(hopper_args("part", resume="models/part/latest"))
    assert_same_training(uninterrupted, final_state("part"))

    # Ctrl-C at the start of the 2nd PPO update (exploration): after the rollout was copied into the replay buffer
    # and the normalisers updated; the checkpoint takes them back to the iteration's start.
    updates, real_update = [0], pref_ppo.ppo_update

    def update(*args, **kwargs):
        updates[0] += 1
        if updates[0] == 2:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(pref_ppo, "ppo_update", update)
    with pytest.raises(KeyboardInterrupt):
        pref_ppo.main(hopper_args("late"))
    monkeypatch.setattr(pref_ppo, "ppo_update", real_update)
    assert final_state("late")["checkpoint"]["loop"]["global_step"] == 512
    pref_ppo.main(hopper_args("late", resume="models/late/latest"))
    assert_same_training(uninterrupted, final_state("late"))

    # Start from the exploration checkpoint the uninterrupted run saved after 1024 steps.
    pref_ppo.main(hopper_args("loaded", exploration_from="models/whole/1024"))
    assert_same_training(uninterrupted, final_state("loaded"))


def test_a_signal_during_an_evaluation_stops_after_it_and_resumes_exactly(chdir_tmp):
    """SIGTERM (SLURM's time limit, bench's stop) in the middle of the evaluation at 1024 steps, after the iteration was
    complete: the run finishes the evaluation (a checkpoint at 1024 without it would leave a gap in the resumed run's
    curve), stops at the iteration boundary, and resumed is the uninterrupted run."""
    from cleanrlhf_utils import run as run_module
    from cleanrlhf_utils.cli import RunInterrupted

    pref_ppo.main(hopper_args("whole", evaluation_frequency=512))
    real_evaluate, calls = run_module.evaluate_and_log, [0]

    def evaluate(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:  # its own: the fixture's monkeypatch also holds the working directory
        patch.setattr(run_module, "evaluate_and_log", evaluate)
        with pytest.raises(RunInterrupted):
            pref_ppo.main(hopper_args("part", evaluation_frequency=512))
    assert final_state("part")["checkpoint"]["loop"]["global_step"] == 1024
    assert [step for step, _ in scalars(Path("runs/part"))["eval/mean_return"]] == [512, 1024]
    pref_ppo.main(hopper_args("part", evaluation_frequency=512, resume="models/part/latest"))
    assert scalars(Path("runs/part"))["eval/mean_return"] == scalars(Path("runs/whole"))["eval/mean_return"]
    assert_same_training(final_state("whole"), final_state("part"))


def test_interrupt_in_reward_update_redoes_it_exactly(chdir_tmp, monkeypatch):
    """Ctrl-C while the reward model trains on the first session's labels: a session's labels,
    its reward update and the relabel are one unit, so the checkpoint holds the state from before the update (the
    session open with its labels, the iteration's start); the resumed run collects that rollout again, redoes the
    update without asking anyone, asks new pairs at the next session, and ends as an uninterrupted run."""
    pref_ppo.main(hopper_args("whole", total_timesteps=2048))
    real_train = pref_ppo.train_reward_model

    def train(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pref_ppo, "train_reward_model", train)
    with pytest.raises(KeyboardInterrupt):
        pref_ppo.main(hopper_args("cut", total_timesteps=2048))
    monkeypatch.setattr(pref_ppo, "train_reward_model", real_train)
    schedule = pref_ppo.feedback_schedule(30, 10, "exponential", 0.8)
    saved = final_state("cut")["checkpoint"]
    assert saved["loop"]["global_step"] == 1024 and saved["loop"]["sessions_done"] == 0
    assert saved["loop"]["labels_obtained"] == len(saved["preference_buffer"]["labels"]) == 0
    assert saved["session"]["answered"].sum() == schedule[0]  # the labels wait in the open session

    summary = pref_ppo.main(hopper_args("cut", total_timesteps=2048, resume="models/cut/latest"))
    prefs = final_state("cut")["checkpoint"]["preference_buffer"]
    assert summary["feedback_sessions"] == 2 and summary["labels_obtained"] == len(prefs["labels"]) == schedule[0] + schedule[1]
    pairs = prefs["obs_actions"].reshape(len(prefs["labels"]), -1)
    assert len(np.unique(pairs, axis=0)) == len(pairs)  # no pair asked twice
    assert list(prefs["global_steps"]) == [1536] * schedule[0] + [2048] * schedule[1]
    assert_same_training(final_state("whole"), final_state("cut"))


def test_human_mode_gets_exactly_the_labels_given(chdir_tmp):
    """pref_ppo.py against a real feedback server (started by the trainer), answered over HTTP by the scripted
    labeller of test_human_feedback.py: left / right / tie / skip by query id."""
    requests = pytest.importorskip("requests")
    from test_human_feedback import ScriptedLabeller, free_port

    base = f"http://127.0.0.1:{free_port()}"
    labeller = ScriptedLabeller(base)
    labeller.start()
    args = hopper_args(
        "human",
        total_timesteps=2048,
        teacher_feedback_mode="human",
        feedback_server_url=base,
        feedback_server_autostart=True,
        feedback_check_clips=1,
        teacher_feedback_total_queries=8,
        teacher_feedback_num_queries_per_session=4,
        teacher_feedback_schedule="linear",
        segment_length=10,
        max_augmentation_offset=3,
        min_augmentation_offset=1,
        clip_width=64,
        clip_height=48,
    )
    try:
        summary = pref_ppo.main(args)
    finally:
        labeller.stop.set()
    labeller.join(timeout=10)

    assert sorted(labeller.given) == list(range(1, 9))  # two sessions of 4 queries, after the rollouts ending at 1536, 2048
    expected = [CHOICE_LABELS[labeller.given[q]] for q in sorted(labeller.given) if labeller.given[q] != "skip"]
    assert summary["labels_obtained"] == len(expected) == 6 and summary["queries_skipped"] == 2
    checkpoint = torch.load("models/human/latest/checkpoint.pt", weights_only=False)
    np.testing.assert_array_equal(checkpoint["preference_buffer"]["labels"], np.array(expected, dtype=np.float32))
    assert checkpoint["teacher"]["cursor"] >= 8
    clips = [path.name for path in Path("videos/human/clips").glob("*.mp4")]
    assert len(clips) == 8 * 2 + 2 + 1  # two clips per query, one check clip per session, the final evaluation's start
    assert [name for name in clips if "_eval_" in name] == ["run1_eval_2048.mp4"]
    with pytest.raises(requests.ConnectionError):  # the trainer stopped the server it started
        requests.get(base + "/api/config", timeout=2)


def test_feedback_async_puts_the_next_pairs_up_before_the_reward_update(chdir_tmp, monkeypatch):
    """As sac_rlhf.py's test in test_feedback_resume.py: with --feedback-async, session 2's pairs are on the page while
    the reward model still learns from session 1's answers (an update made 1.5 s slow), and every answer counts once."""
    pytest.importorskip("requests")
    from test_feedback_resume import Labeller, slow_reward_updates
    from test_human_feedback import free_port

    base = f"http://127.0.0.1:{free_port()}"
    updates = slow_reward_updates(monkeypatch, pref_ppo)
    labeller = Labeller(base, seconds=0.1)
    labeller.start()
    args = hopper_args(
        "staged", total_timesteps=10240, teacher_feedback_mode="human", feedback_server_url=base, feedback_server_autostart=True, feedback_check_clips=0, feedback_async=True, teacher_feedback_total_queries=8,
        teacher_feedback_num_queries_per_session=4, teacher_feedback_frequency=1, teacher_feedback_schedule="linear",
        segment_length=10, max_augmentation_offset=3, min_augmentation_offset=1, clip_width=64, clip_height=48,
    )  # fmt: skip
    try:
        summary = pref_ppo.main(args)
    finally:
        labeller.stop.set()
    labeller.join(timeout=10)
    assert len(updates) == 2 and sorted(labeller.given) == list(range(1, 9)) and labeller.posts == 8
    assert labeller.received_at[5] < updates[0][1], "session 2's first pair came only after session 1's update"
    expected = [CHOICE_LABELS[labeller.given[q]] for q in sorted(labeller.given) if labeller.given[q] != "skip"]
    checkpoint = torch.load("models/staged/latest/checkpoint.pt", weights_only=False)
    np.testing.assert_array_equal(checkpoint["preference_buffer"]["labels"], np.array(expected, dtype=np.float32))
    assert summary["feedback_sessions"] == 2 and summary["labels_obtained"] == len(expected)


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------
def test_cli_bad_input_exits_2_with_one_error_line(tmp_path):
    env = {**os.environ, "MUJOCO_GL": "egl", "WANDB_MODE": "offline"}
    commands = {
        "pref_ppo": [sys.executable, str(REPO_ROOT / "framework/pref_ppo.py"), "--total-timesteps", "100"],
        "ppo": [sys.executable, str(REPO_ROOT / "framework/ppo.py"), "--env-id", "Nope-v0"],
    }
    processes = {}
    for name, command in commands.items():
        (tmp_path / name).mkdir()
        processes[name] = subprocess.Popen(command, cwd=tmp_path / name, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    expected = {"pref_ppo": ["--total-timesteps (100)", "2048"], "ppo": ["--env-id Nope-v0"]}
    for name, process in processes.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr
        assert sum(line.startswith("error:") for line in lines) == 1
        assert all(text in lines[-1] for text in expected[name]), lines[-1]
        assert list((tmp_path / name).iterdir()) == []  # nothing written


BAD_ARGS = [
    ("too-few-steps", {"total_timesteps": 1000}, "--total-timesteps (1000) must hold at least one rollout"),
    ("num-envs", {"num_envs": 0}, "--num-envs must be >= 1, got 0"),
    ("minibatches", {"num_minibatches": 0}, "--num-minibatches must be >= 1"),
    ("gae-lambda", {"gae_lambda": 1.5}, "--gae-lambda must be in [0, 1], got 1.5"),
    ("target-kl", {"target_kl": 0.0}, "--target-kl must be > 0"),
    ("unknown-env", {"env_id": "Nope-v0"}, "--env-id Nope-v0 is not a registered"),
    ("negative-queries", {"teacher_feedback_total_queries": -5}, "--teacher-feedback-total-queries must be >= 0, got -5"),
    ("offsets", {"min_augmentation_offset": 8, "max_augmentation_offset": 3}, "--min-augmentation-offset (8)"),
    ("surf-tau", {"surf_tau": 1.0}, "--surf-tau"),
    ("eps-mistake", {"teacher_eps_mistake": 1.5}, "--teacher-eps-mistake must be in [0, 1], got 1.5"),
    ("explore-steps", {"total_explore_steps": -1}, "--total-explore-steps must be >= 0"),
    ("exploration-from", {"exploration_from": "no/such/run"}, "--exploration-from no/such/run: no checkpoint there"),
    ("file-mode", {"teacher_feedback_mode": "file"}, "--teacher-feedback-mode file needs --feedback-file"),
    ("missing-resume", {"resume": "no/such/run"}, "--resume no/such/run: no checkpoint.pt"),
]


@pytest.mark.parametrize(("overrides", "message"), [(o, m) for _, o, m in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_validate_args_rejects(overrides, message):
    with pytest.raises(pref_ppo.ConfigError) as error:
        pref_ppo.validate_args(pref_ppo.Args(**overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_validate_args_accepts_good_configurations():
    pref_ppo.validate_args(pref_ppo.Args())
    pref_ppo.validate_args(pref_ppo.Args(env_id="CartPole-v1", num_envs=4, num_steps=128, unsupervised_exploration=False))
    pref_ppo.validate_ppo_args(pref_ppo.PPOArgs(env_id="Pendulum-v1", target_kl=0.02))


def test_main_fails_before_writing_anything(chdir_tmp):
    with pytest.raises(pref_ppo.ConfigError, match="--total-timesteps"):
        pref_ppo.main(pref_ppo.Args(total_timesteps=10, progress_bar=False))
    import ppo

    with pytest.raises(pref_ppo.ConfigError, match="--num-steps must be >= 1"):
        ppo.main(ppo.Args(num_steps=0, progress_bar=False))
    assert list(chdir_tmp.iterdir()) == []
