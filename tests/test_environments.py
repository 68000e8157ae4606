"""Both environment families, Gymnasium MuJoCo v5 and the DeepMind Control Suite through shimmy, on a
representative subset: build, step, store physics states, re-render a stored segment to the frames seen
live, and a short run of each script. framework/list_envs.py runs the checks on every id."""

import json
from dataclasses import replace
from pathlib import Path

import mujoco
import numpy as np
import pytest
import torch
from test_end_to_end import assert_same_training, final_state, scalars, small_args
from test_pref_ppo import hopper_args

import list_envs
import pref_ppo
import sac_rlhf
from cleanrlhf_utils.envs import SegmentRenderer, get_physics_state

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_IDS = ["Hopper-v5", "Swimmer-v5", "dm_control/cartpole-swingup-v0", "dm_control/walker-walk-v0"]
SCRIPT_ENV_IDS = [
    "Hopper-v5",
    "Walker2d-v5",
    "HalfCheetah-v5",
    "Ant-v5",
    "Swimmer-v5",
    "dm_control/walker-walk-v0",
    "dm_control/cheetah-run-v0",
    "dm_control/quadruped-walk-v0",
]
WIDTH, HEIGHT = 64, 48


class LiveFrames:
    """Frames of the live env as it steps, drawn the way SegmentRenderer draws them (no re-rendering)."""

    def __init__(self, env):
        self.env = env
        self.physics = getattr(env.unwrapped, "physics", None)
        if self.physics is not None:
            self.renderer = mujoco.Renderer(self.physics.model._model, HEIGHT, WIDTH)

    def __call__(self) -> np.ndarray:
        if self.physics is None:
            # Gymnasium's step leaves positions-derived data one substep behind the integration; mj_forward
            # brings them to the current state (changing no state) so the frame shows the state stored with it.
            mujoco.mj_forward(self.env.unwrapped.model, self.env.unwrapped.data)
            return self.env.render()
        self.renderer.update_scene(self.physics.data._data, camera=0)
        return self.renderer.render()

    def close(self):
        if self.physics is not None:
            self.renderer.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_stored_segment_rerenders_to_the_live_frames(env_id):
    env = sac_rlhf.make_env(env_id, seed=0, render_mode="rgb_array", width=WIDTH, height=HEIGHT)()
    space = env.action_space
    # Dict observations (dm_control) arrive flattened into one float vector.
    obs, _ = env.reset(seed=0)
    obs_dim, action_dim = int(np.prod(env.observation_space.shape)), int(np.prod(space.shape))
    assert obs.shape == (obs_dim,) and env.observation_space.contains(obs)

    # The actor squashes into the env's own bounds (dm_control's come from its action spec).
    torch.manual_seed(0)
    actor = sac_rlhf.Actor(obs_dim, space.low, space.high, 32, 2)
    live = LiveFrames(env)
    rb = sac_rlhf.ReplayBuffer(100, obs_dim, action_dim, sac_rlhf.physics_state_size(env))
    frames = []
    for _ in range(30):
        with torch.no_grad():
            action, _, _ = actor.get_action(torch.as_tensor(obs, dtype=torch.float32)[None] * 10)  # large inputs: saturated actions
        action = action[0].numpy()
        assert np.all(action >= space.low) and np.all(action <= space.high)
        frames.append(live())
        state = get_physics_state(env)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rb.add(obs, next_obs, action, reward, terminated, 0, state)
        obs = next_obs
        if terminated or truncated:
            break
    live.close()
    env.close()
    assert rb.size >= 10
    assert np.ptp(rb.actions[: rb.size], axis=0).max() > 0  # actions really varied

    renderer = SegmentRenderer(env_id, WIDTH, HEIGHT, shadows=True)
    try:
        reversed_frames = renderer.render_states(rb.physics_states[: rb.size][::-1])[::-1]  # order must not matter
        rerendered = renderer.render_states(rb.physics_states[: rb.size])
    finally:
        renderer.close()
    np.testing.assert_array_equal(rerendered, np.stack(frames))
    np.testing.assert_array_equal(reversed_frames, rerendered)
    assert rerendered.reshape(rb.size, -1).std(axis=1).min() > 0  # a scene, not a blank image


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_pebble_runs_on(chdir_tmp, env_id):
    run_name = env_id.replace("/", "_")
    args = small_args(
        run_name,
        env_id=env_id,
        total_timesteps=500,
        learning_starts=100,
        total_explore_steps=200,
        teacher_feedback_total_queries=10,
        teacher_feedback_num_queries_per_session=5,
        teacher_feedback_frequency=150,
        segment_length=10,
        evaluation_frequency=250,
    )
    summary = sac_rlhf.main(args)
    assert summary["env_id"] == env_id and summary["global_step"] == 500
    assert summary["feedback_sessions"] == 2 and summary["labels_obtained"] + summary["queries_skipped"] == 10
    assert np.isfinite(summary["final_eval_return"]) and np.isfinite(summary["reward_correlation"])
    tags = scalars(Path("runs") / run_name)
    assert [step for step, _ in tags["eval/mean_return"]] == [250, 500]
    # The checkpoint's replay buffer holds one physics state per step, of the env's own state size.
    stored = np.load(Path("models") / run_name / "latest" / "replay_buffer.npz")
    env = sac_rlhf.make_env(env_id, 0)()
    assert stored["physics_states"].shape[1] == sac_rlhf.physics_state_size(env)
    env.close()
    assert np.abs(stored["physics_states"][:500]).sum(axis=1).min() > 0


def test_pebble_resumes_exactly_on_the_control_suite(chdir_tmp):
    # dm_control draws from a legacy RandomState and counts its time limit inside the suite's Environment:
    # both, and the solver's warm start, must be in the checkpoint for a resumed run to continue bit for bit.
    settings = {"env_id": "dm_control/cartpole-swingup-v0", "total_timesteps": 700, "learning_starts": 100, "total_explore_steps": 200}
    sac_rlhf.main(small_args("whole", **settings, teacher_feedback_frequency=200, segment_length=10))
    sac_rlhf.main(small_args("part", **settings | {"total_timesteps": 450}, teacher_feedback_frequency=200, segment_length=10))
    assert final_state("part")["checkpoint"]["env"]["envs"][0]["episode_counters"]["_step_count"] == 450  # mid-episode (1000 steps)
    sac_rlhf.main(small_args("part", **settings, teacher_feedback_frequency=200, segment_length=10, resume="models/part/latest"))
    assert_same_training(final_state("whole"), final_state("part"))


def test_pref_ppo_runs_on_the_control_suite(chdir_tmp):
    args = hopper_args("walker", env_id="dm_control/walker-walk-v0", total_timesteps=2048, total_explore_steps=512)
    summary = pref_ppo.main(args)
    assert summary["env_id"] == "dm_control/walker-walk-v0" and summary["labels_obtained"] + summary["queries_skipped"] == 30
    assert np.isfinite(summary["final_eval_return"])


# ----------------------------------------------------------------------------------------
# --no-terminate-when-unhealthy
# ----------------------------------------------------------------------------------------
def falling_hopper_steps(terminate_when_unhealthy: bool, steps: int = 200) -> list[bool]:
    env = sac_rlhf.make_env("Hopper-v5", 0, terminate_when_unhealthy=terminate_when_unhealthy)()
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    terminated_flags = []
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, 3).astype(np.float32))
        terminated_flags.append(terminated)
        if terminated or truncated:
            break
    env.close()
    return terminated_flags


def test_no_terminate_when_unhealthy_keeps_a_fallen_hopper_running():
    default = falling_hopper_steps(True)
    assert default[-1] and len(default) < 100  # random actions topple Hopper quickly
    kept = falling_hopper_steps(False)
    assert len(kept) == 200 and not any(kept)


@pytest.mark.parametrize("script", ["sac_rlhf", "pref_ppo"])
def test_no_terminate_when_unhealthy_reaches_training_and_evaluation(chdir_tmp, script):
    # Hopper's time limit is 1000 steps, so without unhealthy termination no episode ends in 800 steps,
    # while the default run ends dozens (random actions topple it within ~25 steps).
    no_feedback = {"unsupervised_exploration": False, "total_explore_steps": 0, "teacher_feedback_total_queries": 0}
    if script == "sac_rlhf":
        runs = {name: small_args(name, total_timesteps=800, **no_feedback) for name in ("default", "kept")}
        main = sac_rlhf.main
    else:
        runs = {name: hopper_args(name, total_timesteps=1024, **no_feedback) for name in ("default", "kept")}
        main = pref_ppo.main
    summary_default = main(runs["default"])
    summary_kept = main(replace(runs["kept"], terminate_when_unhealthy=False))
    assert len(scalars(Path("runs/default"))["charts/episodic_length"]) > 10
    assert "charts/episodic_length" not in scalars(Path("runs/kept"))
    assert json.loads(Path("runs/kept/args.json").read_text())["terminate_when_unhealthy"] is False
    # Evaluation runs the same env: episodes of the trained-for-800-steps policy last much longer without termination.
    assert summary_default["final_eval_return"] != summary_kept["final_eval_return"]


def test_evaluation_py_keeps_the_training_termination(chdir_tmp):
    import evaluation

    args = small_args("kept", terminate_when_unhealthy=False, total_timesteps=300, learning_starts=100, total_explore_steps=0)
    sac_rlhf.main(replace(args, unsupervised_exploration=False, teacher_feedback_total_queries=0))
    kept = evaluation.main(evaluation.Args(path_to_model="models/kept/latest", episodes=1))
    forced = evaluation.main(evaluation.Args(path_to_model="models/kept/latest", episodes=1, terminate_when_unhealthy=True))
    assert kept["returns"][0] != forced["returns"][0]


def hopper_ends_when_tilted_and_when_fallen(module, **termination) -> tuple[bool, bool]:
    """(whether a step with the torso turned 1 rad backwards but 1.25 m high ends the episode, whether a step with it
    lying at 0.3 m does)."""
    env = module.make_env("Hopper-v5", 0, **termination)()
    env.reset(seed=0)
    ended = []
    for height in (1.25, 0.3):
        qpos = env.unwrapped.init_qpos.copy()
        qpos[1], qpos[2] = height, -1.0
        env.unwrapped.set_state(qpos, np.zeros(env.unwrapped.model.nv))
        ended.append(bool(env.step(np.zeros(3, dtype=np.float32))[2]))
    env.close()
    return ended[0], ended[1]


@pytest.mark.parametrize("module", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_no_terminate_when_tilted_ends_episodes_on_a_fall_only(module):
    assert hopper_ends_when_tilted_and_when_fallen(module) == (True, True)
    assert hopper_ends_when_tilted_and_when_fallen(module, terminate_when_tilted=False) == (False, True)
    assert hopper_ends_when_tilted_and_when_fallen(module, terminate_when_unhealthy=False, terminate_when_tilted=False) == (False, False)


def test_evaluation_py_keeps_the_training_tilt_termination(chdir_tmp):
    import evaluation

    args = small_args("fall_only", terminate_when_tilted=False, total_timesteps=300, learning_starts=100, total_explore_steps=0)
    sac_rlhf.main(replace(args, unsupervised_exploration=False, teacher_feedback_total_queries=0))
    assert json.loads(Path("runs/fall_only/args.json").read_text())["terminate_when_tilted"] is False
    kept = evaluation.main(evaluation.Args(path_to_model="models/fall_only/latest", episodes=1))
    forced = evaluation.main(evaluation.Args(path_to_model="models/fall_only/latest", episodes=1, terminate_when_tilted=True))
    # Hopper pays 1 per healthy step: ending only on a fall, the barely trained policy's episode lasts longer
    assert kept["returns"][0] > forced["returns"][0]


@pytest.mark.parametrize("env_id", ["Ant-v5", "Swimmer-v5"])
def test_no_terminate_when_tilted_is_refused_where_the_env_has_no_angle_termination(env_id):
    with pytest.raises(sac_rlhf.ConfigError) as error:
        sac_rlhf.make_env(env_id, 0, terminate_when_tilted=False)()
    message = str(error.value)
    assert message.startswith(f"--no-terminate-when-tilted: {env_id} has no termination on the torso's angle")
    assert message.split("have it: ")[1].rstrip(")").split(", ") == ["Hopper-v5", "Walker2d-v5"]


@pytest.mark.parametrize("module", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_no_terminate_when_unhealthy_is_refused_where_the_env_has_no_such_termination(module):
    with pytest.raises(module.ConfigError) as error:
        module.make_env("Swimmer-v5", 0, terminate_when_unhealthy=False)()
    message = str(error.value)
    assert "--no-terminate-when-unhealthy" in message and "Swimmer-v5" in message
    assert "Hopper-v5" in message and "Walker2d-v5" in message and "Swimmer-v5" not in message.split("have it:")[1]


# ----------------------------------------------------------------------------------------
# Environments the scripts cannot take: one clear reason
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module", "env_id", "message"),
    [
        (sac_rlhf, "dm_control/lqr-lqr_2_1-v0", "has unbounded actions"),
        (sac_rlhf, "dm_control/walker-fly-v0", "is not a registered Gymnasium environment (similar ids that run here: dm_control/walker-"),
        (pref_ppo, "dm_control/walker-fly-v0", "is not a registered Gymnasium environment"),
        (sac_rlhf, "CartPole-v1", "has a Discrete action space"),
        (pref_ppo, "dm_control/stack_2_bricks_vision-v0", "observes camera images"),
        (sac_rlhf, "dm_control/stack_2_bricks_vision-v0", "observes camera images"),
    ],
)
def test_unsupported_envs_are_refused_with_the_reason(module, env_id, message):
    with pytest.raises(module.ConfigError) as error:
        module.make_env(env_id, 0)()
    assert message in str(error.value) and env_id in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------
# docs/reference/working-envs.md: generated, complete, and right about the envs tested here
# ----------------------------------------------------------------------------------------
def test_an_env_registered_elsewhere_on_a_gymnasium_class_is_not_a_candidate():
    """The page lists Gymnasium's own MuJoCo ids: a variant some module registered in this process (a benchmark's
    Ant without its contact forces, imported by an earlier test) must not change what the page has to cover."""
    import gymnasium as gym

    before = list_envs.candidate_env_ids()
    ant = "gymnasium.envs.mujoco.ant_v5:AntEnv"
    gym.register("AntVariantOfATest-v5", entry_point=ant, kwargs={"healthy_reward": 2.0})
    try:
        assert list_envs.candidate_env_ids() == before and "Ant-v5" in before
    finally:
        del gym.registry["AntVariantOfATest-v5"]


def test_working_envs_md_covers_every_candidate_id():
    rows = list_envs.read_markdown(list_envs.WORKING_ENVS_PAGE)
    assert set(rows) == set(list_envs.candidate_env_ids()), "regenerate with: python framework/list_envs.py"
    for env_id in set(ENV_IDS) | set(SCRIPT_ENV_IDS):
        assert rows[env_id]["sac_rlhf"] == "pass" and rows[env_id]["pref_ppo"] == "pass", rows[env_id]
    for row in rows.values():
        assert row["sac_rlhf"] in ("pass", "partial", "fail") and (row["sac_rlhf"] == "pass" or row["reason"]), row


def test_list_envs_reports_pass_and_fail_with_reasons(tmp_path):
    output = tmp_path / "envs.md"
    rows = list_envs.main(list_envs.Args(output=str(output), only=["Swimmer-v5", "lqr-lqr_2_1"], segment_length=10, width=32, height=32))
    written = list_envs.read_markdown(output)
    assert set(written) == {"Swimmer-v5", "dm_control/lqr-lqr_2_1-v0"} == {row["env_id"] for row in rows}
    assert written["Swimmer-v5"]["sac_rlhf"] == "pass" and written["Swimmer-v5"]["replay"] == "exact"
    lqr = written["dm_control/lqr-lqr_2_1-v0"]
    assert lqr["sac_rlhf"] == "fail" and "unbounded actions" in lqr["reason"] and lqr["pref_ppo"] == "pass"


def test_autoreset_pending_is_the_one_reader_of_gymnasiums_private_flags():
    """Gymnasium keeps next-step autoreset flags in a private attribute: envs.autoreset_pending is its one reader, and it
    must follow the vector env (an episode's end raises the flag, the resetting step lowers it)."""
    import gymnasium as gym

    from cleanrlhf_utils.envs import autoreset_pending

    for path in sorted((REPO_ROOT / "framework").rglob("*.py")) + sorted((REPO_ROOT / "bench").glob("*.py")):
        if path.name != "envs.py":
            assert "_autoreset_envs" not in path.read_text(), path
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    envs.reset(seed=0)
    ended = False
    for _ in range(500):
        pending_before = bool(autoreset_pending(envs)[0])
        _, _, terminated, truncated, _ = envs.step(np.array([0]))
        if pending_before:
            assert not autoreset_pending(envs)[0] and ended
            break
        ended = bool(terminated[0] or truncated[0])
        assert bool(autoreset_pending(envs)[0]) == ended
    else:
        raise AssertionError("CartPole pushed one way never ended its episode")
    envs.close()
