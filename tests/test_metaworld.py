"""Meta-World (metaworld/<task>): stored states replay and re-render exactly, success is counted per episode, and
both algorithm scripts, evaluation.py, the sweep and the toolbox report the success rate."""

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from test_end_to_end import scalars, small_args
from test_pref_ppo import hopper_args

import pref_ppo
import sac_rlhf
import sweep
from cleanrlhf_utils.envs import SegmentRenderer, get_physics_state, make_env, reached_success, set_physics_state
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.evaluate import EvalReturn, success_rate, success_summary

ENV_ID = "metaworld/door-open-v3"
WIDTH, HEIGHT = 64, 48


def test_restored_states_replay_and_the_segment_rerenders_in_an_env_of_another_seed():
    env = sac_rlhf.make_env(ENV_ID, seed=3, render_mode="rgb_array", width=WIDTH, height=HEIGHT)()
    obs, _ = env.reset(seed=3)
    assert obs.shape == (39,) and env.observation_space.contains(obs)  # the goal is observed and inside the space
    assert np.abs(obs[-3:]).sum() > 0
    states, actions, next_obs, frames = [], [], [], []
    for _ in range(15):
        action = env.action_space.sample()
        frames.append(env.render())
        states.append(get_physics_state(env))
        obs, _, terminated, truncated, _ = env.step(action)
        actions.append(action)
        next_obs.append(obs)
        assert not terminated and not truncated
    # Each stored state with its action gives the next observation again (reversed: nothing leaks from the previous one).
    for t in reversed(range(len(states))):
        set_physics_state(env, states[t])
        replayed, *_ = env.step(actions[t])
        np.testing.assert_allclose(replayed, next_obs[t], rtol=0, atol=1e-9)
    env.close()

    # The renderer is built with seed 0, another layout: the states carry theirs, and the clip is the live frames.
    other = sac_rlhf.make_env(ENV_ID, seed=0)()
    assert not np.array_equal(other.reset(seed=0)[0][-3:], next_obs[0][-3:])  # another goal
    other.close()
    renderer = SegmentRenderer(ENV_ID, WIDTH, HEIGHT, shadows=True)
    try:
        rerendered = renderer.render_states(np.stack(states))
    finally:
        renderer.close()
    np.testing.assert_array_equal(rerendered, np.stack(frames))
    assert rerendered.reshape(len(states), -1).std(axis=1).min() > 0


def test_episodes_are_500_steps_and_one_layout_per_seed():
    env = sac_rlhf.make_env(ENV_ID, seed=1)()
    first, _ = env.reset(seed=1)
    steps, truncated = 0, False
    while not truncated:
        _, _, terminated, truncated, info = env.step(env.action_space.sample())
        steps += 1
        assert not terminated and info["success"] in (0.0, 1.0)
    assert steps == 500
    again, _ = env.reset(seed=7)  # the layout stays: resets with other seeds start where the first did
    np.testing.assert_array_equal(again, first)
    env.close()
    evaluation_env = make_env(ENV_ID, seed=100_001, task_seed=1)()  # evaluations pass the run's seed as task_seed
    np.testing.assert_array_equal(evaluation_env.reset(seed=100_001)[0], first)
    evaluation_env.close()


def test_success_is_reached_at_any_step_of_an_episode():
    assert reached_success([{"success": 0.0}, {"success": 1.0}, {"success": 0.0}])  # switched off again: still a success
    assert not reached_success([{"success": 0.0}] * 3)
    assert reached_success([{"success": True}])
    assert reached_success([{}, {}]) is None  # envs without success (Gymnasium MuJoCo, DMC)
    assert reached_success([]) is None
    assert success_rate([True, False, False, True]) == 0.5
    assert success_rate([None, None]) is None


def test_an_evaluation_is_a_float_that_carries_its_success_rate():
    result = EvalReturn(12.5, 0.3)
    assert result == 12.5 and f"{result:.0f}" == "12" and result.success_rate == 0.3
    for copied in (copy.deepcopy(result), pickle.loads(pickle.dumps(result))):  # checkpoints keep it in the loop state
        assert copied == 12.5 and copied.success_rate == 0.3
    assert success_summary(result) == {"final_success_rate": 0.3}
    assert success_summary(EvalReturn(1.0)) == success_summary(float("nan")) == {}
    assert json.loads(json.dumps({"value": result})) == {"value": 12.5}


def test_the_sweep_takes_the_success_rate_as_its_metric():
    summary = {"env_id": ENV_ID, "final_eval_return": 100.0, "final_success_rate": 0.4}
    assert sweep.metric_value("final_success_rate", summary, Path("nowhere")) == 0.4
    assert sweep.metric_value("eval/success_rate", summary, Path("nowhere")) == 0.4
    assert sweep.evaluation_value("eval/success_rate", EvalReturn(100.0, 0.4)) == 0.4  # what the pruner sees mid-run
    assert sweep.evaluation_value("eval/mean_return", EvalReturn(100.0, 0.4)) == 100.0
    with pytest.raises(sweep.SweepError, match="reports no success"):
        sweep.metric_value("final_success_rate", {"env_id": "Hopper-v5", "final_eval_return": 1.0}, Path("nowhere"))


def test_an_unknown_task_names_the_close_ones():
    with pytest.raises(ConfigError, match="metaworld/door-open-v3"):
        sac_rlhf.make_env("metaworld/door-open-v2", 0)()


def test_pebble_run_logs_the_success_rate_everywhere(chdir_tmp, capsys, monkeypatch):
    import evaluation

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "toolbox"))
    import compare

    args = small_args(
        "mw", env_id=ENV_ID, total_timesteps=600, learning_starts=100, total_explore_steps=200, teacher_feedback_total_queries=10
    )
    summary = sac_rlhf.main(args)
    tags = scalars(Path("runs/mw"))
    assert [step for step, _ in tags["eval/success_rate"]] == [600]
    assert summary["final_success_rate"] == tags["eval/success_rate"][-1][1] in (0.0, 1.0)
    assert json.loads(Path("runs/mw/summary.json").read_text())["final_success_rate"] == summary["final_success_rate"]

    result = evaluation.main(evaluation.Args(path_to_model="models/mw/latest", episodes=1, seed=100_000))
    assert result["success_rate"] == summary["final_success_rate"] and result["mean_return"] == pytest.approx(summary["final_eval_return"])
    assert f"success rate {result['success_rate']:.2f}" in capsys.readouterr().out

    report = compare.main(compare.Args(runs=["runs/mw"], out="report", bootstrap_reps=10))
    assert "success_vs_steps.png" in [path.name for path in report["plots"]]
    assert report["rows"][0]["final_success_rate"] == summary["final_success_rate"]


def test_pref_ppo_run_logs_the_success_rate(chdir_tmp):
    args = hopper_args("mw_ppo", env_id=ENV_ID, total_timesteps=1024, total_explore_steps=512, teacher_feedback_frequency=256)
    summary = pref_ppo.main(args)
    assert [step for step, _ in scalars(Path("runs/mw_ppo"))["eval/success_rate"]] == [1024]
    assert summary["final_success_rate"] in (0.0, 1.0)


def test_envs_without_success_log_no_success_rate(chdir_tmp):
    summary = sac_rlhf.main(
        small_args("hopper", total_timesteps=300, learning_starts=100, total_explore_steps=0, unsupervised_exploration=False)
    )
    assert "final_success_rate" not in summary and "eval/success_rate" not in scalars(Path("runs/hopper"))
