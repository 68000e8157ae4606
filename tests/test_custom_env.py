"""Your own environment: `--env-id my_package.my_module:MyEnv-v0` (Gymnasium's "module:id" form) in both algorithm
scripts and the baselines; the shipped zero-reward windmill has what Gymnasium MuJoCo envs have (exact states, clips);
a run on it learns only from labels; an env without simulator state trains with the synthetic teacher and human mode
refuses it in one line."""

import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from cleanrlhf_utils.envs import (
    SegmentRenderer,
    capture_env_state,
    check_env_id,
    get_physics_state,
    is_mujoco_env,
    make_env,
    restore_env_state,
    set_physics_state,
)
from cleanrlhf_utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
WINDMILL = "cleanrlhf_utils.example_envs.windmill:Windmill-v0"
ANT_WITHOUT_CONTACT_FORCES = "cleanrlhf_utils.example_envs.ant_without_contact_forces:AntWithoutContactForces-v5"

STATELESS_MODULE = '''
import gymnasium as gym
import numpy as np


class Line(gym.Env):
    """A point on a line that should go right: no MuJoCo, no `state` attribute (nothing to re-render from)."""

    observation_space = gym.spaces.Box(-10.0, 10.0, shape=(1,), dtype=np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._x = float(self.np_random.uniform(-1, 1))
        return np.array([self._x], dtype=np.float32), {}

    def step(self, action):
        self._x = float(np.clip(self._x + 0.1 * float(action[0]), -10, 10))
        return np.array([self._x], dtype=np.float32), self._x, False, False, {}


gym.register("Line-v0", entry_point=Line, max_episode_steps=50)
'''


def test_windmill_has_no_reward_and_exact_state_round_trips():
    envs = gym.vector.SyncVectorEnv([make_env(WINDMILL, 0)], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    obs, _ = envs.reset(seed=0)
    rewards = []
    for _ in range(30):
        obs, reward, *_ = envs.step(np.array([[0.7]], dtype=np.float32))
        rewards.append(float(reward[0]))
    saved = capture_env_state(envs, obs)
    actions = np.random.default_rng(0).uniform(-1, 1, (20, 1, 1)).astype(np.float32)
    first = [envs.step(action)[0] for action in actions]
    restored = restore_env_state(envs, saved)
    second = [envs.step(action)[0] for action in actions]
    envs.close()
    assert rewards == [0.0] * 30
    assert np.array_equal(restored, saved["obs"]) if "obs" in saved else True
    assert np.array_equal(np.stack(first), np.stack(second))  # bit for bit


def test_windmill_is_a_mujoco_env_and_its_clips_render():
    assert is_mujoco_env(WINDMILL)
    env = make_env(WINDMILL, 0)()
    env.reset(seed=0)
    states = []
    for angle in (0.0, 0.8):
        set_physics_state(env, np.concatenate([[0.0, angle, 0.0], get_physics_state(env)[3:]]))
        states.append(get_physics_state(env))
    env.close()
    renderer = SegmentRenderer(WINDMILL, 64, 48)
    try:
        frames = renderer.render_states(np.stack(states))
    finally:
        renderer.close()
    assert frames.shape == (2, 48, 64, 3) and not np.array_equal(frames[0], frames[1])  # the rotor turned


def test_the_ant_without_contact_forces_is_ant_v5_less_those_numbers():
    """scripts/Ant-v5.sh's env, built as the scripts build it: Ant-v5's physics, reward and episode, 27 numbers seen."""
    full = make_env("Ant-v5", seed=3, terminate_when_unhealthy=False)()
    less = make_env(ANT_WITHOUT_CONTACT_FORCES, seed=3, terminate_when_unhealthy=False)()
    assert full.observation_space.shape == (105,) and less.observation_space.shape == (27,)
    full_obs, _ = full.reset(seed=3)
    less_obs, _ = less.reset(seed=3)
    np.testing.assert_array_equal(full_obs[:27], less_obs)
    rng = np.random.default_rng(0)
    for _ in range(30):  # the same physics and reward (the contact cost is still charged), fewer numbers observed
        action = rng.uniform(-1, 1, 8)
        full_step, less_step = full.step(action), less.step(action)
        np.testing.assert_array_equal(full_step[0][:27], less_step[0])
        assert full_step[1:4] == less_step[1:4]
    np.testing.assert_array_equal(get_physics_state(full), get_physics_state(less))
    full.close()
    less.close()


def test_module_env_ids_that_do_not_resolve_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="module no_such_package_xyz does not import") as error:
        check_env_id("no_such_package_xyz:Thing-v0")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="registered no environment Nope-v0"):
        check_env_id("cleanrlhf_utils.example_envs.windmill:Nope-v0")
    check_env_id(WINDMILL)


def tiny(script, **overrides):
    common = dict(
        env_id=WINDMILL, seed=1, torch_threads=1, cuda=False, progress_bar=False, evaluation_frequency=0, evaluation_episodes=2,
        teacher_feedback_num_queries_per_session=10, reward_net_epochs=10, segment_length=25,
    )  # fmt: skip
    return script.Args(**(common | overrides))


def test_zero_reward_windmill_learns_its_direction_from_labels_alone(chdir_tmp):
    """PrefPPO on the windmill, whose reward is 0 at every step, with 30 labels from windmill-counterclockwise: the
    evaluation's env return is exactly 0 and the policy turns counter-clockwise most of the time (it learned from
    labels only)."""
    import pref_ppo

    args = tiny(
        pref_ppo, run_name="windmill", teacher_objective="windmill-counterclockwise", total_timesteps=4096, num_steps=512,
        total_explore_steps=1024, teacher_feedback_frequency=1024, teacher_feedback_total_queries=30,
    )  # fmt: skip
    summary = pref_ppo.main(args)
    assert summary["final_eval_return"] == 0.0 and summary["labels_obtained"] == 30
    assert summary["final_objective_success"] > 0.8, summary
    assert summary["final_objective_return"] > 0
    # The reward model is measured against what the labels meant (the env's reward is 0: nothing to measure there).
    assert summary["heldout_accuracy"] > 0.8 and summary["reward_correlation"] > 0.5, summary


def test_sac_rlhf_trains_on_the_windmill_with_an_objective(chdir_tmp):
    import sac_rlhf

    args = tiny(
        sac_rlhf, run_name="windmill_sac", teacher_objective="windmill-clockwise", total_timesteps=600, learning_starts=200,
        total_explore_steps=300, teacher_feedback_frequency=300, teacher_feedback_total_queries=20, batch_size=32,
        actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32,
    )  # fmt: skip
    summary = sac_rlhf.main(args)
    assert summary["final_eval_return"] == 0.0 and summary["labels_obtained"] > 0
    assert "final_objective_return" in summary and "final_objective_success" in summary

    import evaluation  # the standalone evaluation measures the objective the model was trained with

    result = evaluation.main(evaluation.Args(path_to_model="models/windmill_sac/latest", episodes=2))
    assert result["env_id"] == WINDMILL and result["mean_return"] == 0.0
    assert result["objective"] == "windmill-clockwise" and len(result["objective_returns"]) == 2 and 0 <= result["objective_success"] <= 1


def test_toolbox_compares_module_env_runs_by_their_objective(chdir_tmp):
    """Two seeds of a `module:Id` run with default run names (`Windmill-v0__mill__<seed>__<time>`) and the toolbox's
    report on them: one group `mill` (the env's part of the name dropped, as for Gymnasium ids), compared by the
    objective each run measured. Before, the toolbox matched the name against the whole `module:Id` and grouped the
    runs as `Windmill-v0__mill`."""
    import sac_rlhf

    sys.path.insert(0, str(REPO_ROOT / "toolbox"))
    import compare

    summaries = {}
    for seed in (1, 2):
        args = tiny(
            sac_rlhf, exp_name="mill", seed=seed, teacher_objective="windmill-clockwise", total_timesteps=400, learning_starts=100,
            total_explore_steps=200, teacher_feedback_frequency=200, teacher_feedback_total_queries=10, batch_size=32,
            actor_hidden_dim=32, critic_hidden_dim=32, reward_net_hidden_dim=32, reward_net_epochs=3,
            evaluation_frequency=200, evaluation_episodes=1,
        )  # fmt: skip
        summaries[seed] = sac_rlhf.main(args)
    assert all(summary["run_name"].startswith("Windmill-v0__mill__") for summary in summaries.values())
    report = compare.main(compare.Args(runs=["runs"], out="report", bootstrap_reps=50, metric="objective_return"))
    runs = sorted((row for row in report["rows"] if row["run"]), key=lambda row: row["seed"])
    assert [(row["group"], row["seed"]) for row in runs] == [("mill", 1), ("mill", 2)], runs
    for row in runs:
        assert row["final_return"] == pytest.approx(summaries[row["seed"]]["final_objective_return"], rel=1e-5)


def test_baseline_ppo_runs_a_module_env_id(chdir_tmp):
    import ppo

    summary = ppo.main(
        ppo.Args(
            env_id=WINDMILL, total_timesteps=256, num_steps=128, torch_threads=1, cuda=False, progress_bar=False, evaluation_episodes=1
        )
    )
    assert summary["final_eval_return"] == 0.0


def test_env_without_simulator_state_trains_synthetically_and_human_mode_refuses(chdir_tmp, monkeypatch):
    (chdir_tmp / "line_env.py").write_text(STATELESS_MODULE)
    monkeypatch.syspath_prepend(str(chdir_tmp))
    import pref_ppo

    env_id = "line_env:Line-v0"
    assert get_physics_state(make_env(env_id, 0)()).size == 0
    args = tiny(
        pref_ppo, env_id=env_id, run_name="line", total_timesteps=512, num_steps=128, total_explore_steps=128,
        teacher_feedback_frequency=128, teacher_feedback_total_queries=10,
    )  # fmt: skip
    assert pref_ppo.main(args)["labels_obtained"] == 10

    env = dict(os.environ, MUJOCO_GL="egl", WANDB_MODE="offline", PYTHONPATH=str(chdir_tmp))
    command = [
        sys.executable, str(REPO_ROOT / "framework" / "pref_ppo.py"), "--env-id", env_id, "--teacher-feedback-mode", "human",
        "--total-timesteps", "256", "--num-steps", "128", "--run-name", "line_human",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=chdir_tmp, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "exposes no simulator state" in lines[0] and "re-rendered from states" in lines[0], lines


def test_windmill_evaluation_records_a_video_and_measures_the_objective(tmp_path):
    """Evaluation on the example env: an mp4 of the first episode, and the objective measured on the states it lived
    (a policy that always pushes clockwise turns clockwise nearly all the time)."""
    import torch

    from cleanrlhf_utils.evaluate import evaluate_episodes
    from cleanrlhf_utils.objectives import OBJECTIVES

    class Clockwise(torch.nn.Module):
        def deterministic_action(self, obs):
            return torch.ones(obs.shape[0], 1)

    measures, video = [], tmp_path / "eval.mp4"
    returns, _ = evaluate_episodes(
        Clockwise(), WINDMILL, 2, 0, "cpu", video, 64, 48, objective=OBJECTIVES["windmill-clockwise"], objective_measures=measures
    )
    assert returns == [0.0, 0.0] and video.stat().st_size > 0
    assert len(measures) == 2 and all(episode.objective_return > 0 and episode.success > 0.9 for episode in measures)


def test_default_run_name_of_a_module_env_id_is_the_env_id_alone():
    from types import SimpleNamespace

    from cleanrlhf_utils.tracking import default_run_name

    assert default_run_name(SimpleNamespace(env_id=WINDMILL, exp_name="sac_rlhf", seed=1)).startswith("Windmill-v0__sac_rlhf__1__")


def test_sac_baseline_trains_on_the_objective_as_its_reward(chdir_tmp):
    """sac.py --reward-objective: the ceiling of a preference run. Every stored transition's reward is the objective's
    of that step (the windmill's own is 0), and its evaluations measure the objective beside the env's return."""
    import sac
    from cleanrlhf_utils.objectives import OBJECTIVES, step_rewards

    args = sac.Args(
        env_id=WINDMILL, reward_objective="windmill-clockwise", total_timesteps=400, learning_starts=200, batch_size=32,
        actor_hidden_dim=32, critic_hidden_dim=32, evaluation_frequency=0, evaluation_episodes=1, torch_threads=1,
        cuda=False, progress_bar=False, run_name="ceiling",
    )  # fmt: skip
    summary = sac.main(args)
    assert summary["final_eval_return"] == 0.0 and "final_objective_return" in summary
    with np.load("models/ceiling/latest/replay_buffer.npz") as buffer:
        fields = ("obs", "actions", "physics_states", "learned_rewards", "true_rewards")
        obs, actions, states, rewards, env_rewards = (buffer[k][:400] for k in fields)
    expected = step_rewards(OBJECTIVES["windmill-clockwise"], obs, actions, states)
    assert np.abs(expected).max() > 0  # the rotor turned: a test of the objective's reward, not of zeros
    np.testing.assert_allclose(rewards, expected, rtol=1e-6, atol=1e-6)  # what SAC trains on
    assert not env_rewards.any()  # the env's own reward, kept apart
