"""--teacher-objective: the synthetic teacher prefers what the objective rewards; the built-ins measure what their
docstrings say (a planted backflip counts one flip, the windmill's direction has a sign, the Ant's foot height is
MuJoCo's); bad input is one line and exit 2."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from cleanrlhf_utils import objectives
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.cli import command_line_args
from cleanrlhf_utils.envs import get_physics_state, make_env
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.feedback import SyntheticTeacher

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples" / "objectives"
WINDMILL = "cleanrlhf_utils.example_envs.windmill:Windmill-v0"


def hopper_states(pitch: np.ndarray, pitch_rate: np.ndarray) -> np.ndarray:
    """Hopper full-physics states [..., 13] = [time, qpos (6), qvel (6)] with the given pitch and pitch rate."""
    states = np.zeros((*pitch.shape, 13))
    states[..., 1 + 1] = 1.25
    states[..., 1 + objectives.HOPPER_PITCH] = pitch
    states[..., 1 + 6 + objectives.HOPPER_PITCH] = pitch_rate
    return states


def test_planted_backflip_counts_exactly_one_flip():
    flips = objectives.OBJECTIVES["hopper-backflip"].success
    length = 200
    pitch = np.stack(
        [
            np.linspace(0, -2 * np.pi - 0.1, length),  # through -2 pi: one backflip
            np.linspace(0, -2 * np.pi + 0.1, length),  # not quite round
            np.linspace(0, 2 * np.pi + 0.1, length),  # a front flip is no backflip
            np.linspace(0.05, -4 * np.pi - 0.2, length),  # two
        ]
    )
    states = hopper_states(pitch, np.gradient(pitch, axis=1) / 0.008)
    assert flips(None, None, states).tolist() == [1.0, 0.0, 0.0, 2.0]


def test_rolling_over_on_the_ground_is_no_backflip():
    """With termination off a fallen Hopper can roll: a full backward turn with the torso on the ground (0.2 m) scores
    no reward and no flip; the same turn in the air scores both; a turn half up, half down counts only its upper half."""
    length = 200
    pitch = np.linspace(0, -2 * np.pi - 0.3, length)[None].repeat(3, 0)
    states = hopper_states(pitch, np.gradient(pitch, axis=1) / 0.008)
    states[0, :, 1 + objectives.HOPPER_Z] = 0.2  # on the ground
    states[2, length // 2 :, 1 + objectives.HOPPER_Z] = 0.2  # falls halfway through
    rewards = objectives.hopper_backflip(None, None, states)
    assert rewards[0].sum() == 0.0 and rewards[1].sum() == pytest.approx(2 * np.pi + 0.3, rel=0.02)
    assert 0 < rewards[2].sum() < np.pi + 0.3
    assert objectives.hopper_backflips(None, None, states).tolist() == [0.0, 1.0, 0.0]


def test_the_upright_backflip_pays_each_step_up_and_counts_flips_as_the_backflip_does():
    """hopper-backflip-upright: the backflip's rotation plus a small bonus per step with the torso up. Standing still
    earns the bonus alone, a fall halfway earns half of it, a flip earns both; flips count as for hopper-backflip."""
    length = 200
    pitch = np.zeros((3, length))
    pitch[2] = np.linspace(0, -2 * np.pi - 0.3, length)
    states = hopper_states(pitch, np.gradient(pitch, axis=1) / 0.008)
    states[1, length // 2 :, 1 + objectives.HOPPER_Z] = 0.2  # falls halfway through
    upright = objectives.OBJECTIVES["hopper-backflip-upright"]
    returns = upright.reward(None, None, states).sum(1)
    bonus = objectives.HOPPER_UPRIGHT_BONUS * length
    assert returns[0] == pytest.approx(bonus) and returns[1] == pytest.approx(bonus / 2)
    assert returns[2] == pytest.approx(bonus + objectives.hopper_backflip(None, None, states)[2].sum())
    assert upright.success(None, None, states).tolist() == objectives.hopper_backflips(None, None, states).tolist() == [0, 0, 1]


def test_the_upright_backflip_ends_episodes_on_a_fall_unless_the_command_line_says_otherwise():
    import sac_rlhf

    flags = ["--env-id", "Hopper-v5", "--teacher-objective", "hopper-backflip-upright"]
    args = command_line_args(sac_rlhf.Args, flags)
    assert args.terminate_when_unhealthy is True and args.terminate_when_tilted is False
    args = command_line_args(sac_rlhf.Args, [*flags, "--no-terminate-when-unhealthy"])
    assert args.terminate_when_unhealthy is False and args.terminate_when_tilted is False
    assert objectives.check_objective_settings(args).name == "hopper-backflip-upright"


def test_hopper_pitch_is_read_from_the_real_simulator_state():
    """The layout the objective reads ([time, qpos, qvel]) is MuJoCo's, on the real env: a state at pitch -7 rad (past
    one backflip) with a backward pitch rate reads as such."""
    env = make_env("Hopper-v5", 0, terminate_when_unhealthy=False)()
    env.reset(seed=0)
    qpos, qvel = env.unwrapped.init_qpos.copy(), env.unwrapped.init_qvel.copy()
    start = get_physics_state(env)
    qpos[2], qvel[2] = -7.0, -3.0
    env.unwrapped.set_state(qpos, qvel)
    states = np.stack([start, get_physics_state(env)])[None]
    env.close()
    assert objectives.hopper_backflip(None, None, states)[0, 1] == pytest.approx(3.0 * objectives.HOPPER_DT)  # radians per step
    assert objectives.hopper_backflips(None, None, states).tolist() == [1.0]


def test_labels_prefer_the_segment_that_does_more_of_the_objective(algo):
    """Pairs of Hopper segments, one rotating backwards faster than the other: the synthetic teacher with
    hopper-backflip prefers the faster backward rotation every time, whichever side it is on (the env's reward, zero
    here, would tie them all)."""
    rng = np.random.default_rng(0)
    n, length, obs_dim, action_dim = 64, 20, 11, 3
    rates = rng.uniform(-5, 5, size=(n, 2))
    pitch = rates[..., None] * np.linspace(0, 1, length)
    segments = {
        "obs_actions": rng.normal(size=(n, 2, length, obs_dim + action_dim)).astype(np.float32),
        "masks": np.ones((n, 2, length), dtype=bool),
        "true_rewards": np.zeros((n, 2, length), dtype=np.float32),
        "physics_states": hopper_states(pitch, np.repeat(rates[..., None], length, axis=-1)),
    }
    rb = ReplayBuffer(10, obs_dim, action_dim, 13)
    teacher = SyntheticTeacher(-1.0, 1.0, 0.0, 0.0, 0.0, seed=0, rb=rb, objective=objectives.OBJECTIVES["hopper-backflip"])
    labels, annotators = teacher.label(segments, 1)
    backward_second = -rates[:, 1] > -rates[:, 0]
    assert labels.tolist() == backward_second.astype(np.float32).tolist()
    assert annotators == ["synthetic"] * n


@pytest.mark.parametrize("torque", [1.0, -1.0])
def test_windmill_objectives_have_the_rotation_sign(torque):
    """Driven with +1 the rotor turns clockwise: windmill-clockwise is positive and counter-clockwise negative;
    driven with -1, the reverse. Their success measure is the share of time turning their way."""
    env = make_env(WINDMILL, 0)()
    env.reset(seed=0)
    states, rewards = [get_physics_state(env)], []
    for _ in range(60):
        _, reward, *_ = env.step(np.array([torque], dtype=np.float32))
        states.append(get_physics_state(env)), rewards.append(reward)
    env.close()
    states = np.asarray(states)[None]
    clockwise = objectives.OBJECTIVES["windmill-clockwise"]
    counter = objectives.OBJECTIVES["windmill-counterclockwise"]
    assert set(rewards) == {0.0}  # no reward at all
    assert np.sign(clockwise.reward(None, None, states)[0, 1:].sum()) == np.sign(torque)
    assert np.sign(counter.reward(None, None, states)[0, 1:].sum()) == -np.sign(torque)
    mostly, hardly = (clockwise, counter) if torque > 0 else (counter, clockwise)
    assert mostly.success(None, None, states)[0] > 0.8 > 0.1 > hardly.success(None, None, states)[0]


def test_ant_foot_height_is_mujocos():
    """ant-raise-leg's vectorised forward kinematics gives the foot tip MuJoCo computes, in random poses."""
    env = gym.make("Ant-v5").unwrapped
    env.reset(seed=0)
    rng = np.random.default_rng(1)
    ours, theirs = [], []
    for _ in range(5):
        qpos = env.init_qpos.copy()
        qpos[:3] = rng.uniform(-1, 1, 3)
        qpos[3:7] = rng.normal(size=4)
        qpos[3:7] /= np.linalg.norm(qpos[3:7])
        qpos[7:] = rng.uniform(-1.5, 1.5, 8)
        env.set_state(qpos, env.init_qvel)
        geom = env.model.geom("left_ankle_geom").id
        ends = env.data.geom_xpos[geom] + np.outer([1, -1], env.data.geom_xmat[geom].reshape(3, 3)[:, 2] * env.model.geom_size[geom][1])
        theirs.append(ends[:, 2])
        ours.append(objectives.ant_front_left_foot(get_physics_state(env))[0])
    env.close()
    assert any(np.allclose(ours, np.asarray(theirs)[:, side]) for side in (0, 1))


@pytest.mark.parametrize(("upside_down", "ends"), [(False, False), (True, True)])
def test_an_ant_episode_on_raise_leg_ends_when_it_tips_over(upside_down, ends):
    """The env a run on ant-raise-leg makes, stepped by real MuJoCo: an Ant standing up goes on, one turned upside
    down ends its episode (terminated): a tipped-over Ant cannot right itself, so its episode has nothing left to
    learn from."""
    from cleanrlhf_utils.envs import make_env

    env = make_env("Ant-v5", 0, ends_episode=objectives.OBJECTIVES["ant-raise-leg"].ends_episode)()
    env.reset(seed=0)
    qpos = env.unwrapped.init_qpos.copy()
    qpos[2] = 0.6
    qpos[3:7] = [0.0, 1.0, 0.0, 0.0] if upside_down else [1.0, 0.0, 0.0, 0.0]  # half a turn about x: upside down
    env.unwrapped.set_state(qpos, env.unwrapped.init_qvel)
    _, _, terminated, truncated, _ = env.step(np.zeros(8))
    assert (terminated, truncated) == (ends, False)
    env.close()


def test_ant_raise_leg_pays_the_foot_height_only_up_to_just_above_success():
    """Real MuJoCo poses: a foot raised higher than needed earns no more than one just above the success height, so
    leaning further back (what tipped the Ant over) is not paid; below it, higher still pays more."""
    env = gym.make("Ant-v5").unwrapped
    env.reset(seed=0)
    heights, rewards = [], []
    for torso_height in (0.7, 0.8, 0.95, 1.1):
        qpos = env.init_qpos.copy()
        qpos[2], qpos[7:9] = torso_height, [0.0, 0.6]  # level, front-left ankle at its top: the foot 0.32 m below
        env.set_state(qpos, env.init_qvel)
        state = get_physics_state(env)[None]
        heights.append(objectives.ant_front_left_foot(state)[0][0])
        rewards.append(objectives.ant_raise_leg(None, None, state)[0])
    env.close()
    assert heights == sorted(heights) and heights[-1] > heights[-2] > objectives.ANT_FOOT_HEIGHT_PAID
    assert rewards[-1] == rewards[-2] == pytest.approx(objectives.ANT_FOOT_HEIGHT_PAID)
    assert rewards[0] < rewards[1] < rewards[2]


def test_ant_raise_leg_success_is_a_share_of_the_full_episode():
    """Success counts the steps with the foot up out of the env's 1000: an episode that ends after 100 steps with the
    foot up in all of them scores 0.1, not 1 (ending early must not look like holding the leg up)."""
    env = gym.make("Ant-v5").unwrapped
    env.reset(seed=0)
    qpos = env.init_qpos.copy()
    qpos[2], qpos[7:9] = 0.9, [0.0, 0.6]  # torso high and level, front-left leg near its highest
    env.set_state(qpos, env.init_qvel)
    state = get_physics_state(env)
    env.close()
    height, up = objectives.ant_front_left_foot(state)
    assert height > objectives.ANT_FOOT_HEIGHT and up > 0.99
    episode = np.stack([state] * 101)[None]
    assert objectives.ant_leg_raised_share(None, None, episode)[0] == pytest.approx(0.1)


def test_an_ant_segment_padded_past_its_end_is_read_without_a_floating_point_error():
    """A segment that outlives its episode holds zero states on its masked steps, and check_objective probes each
    objective on zeros: a zero quaternion is no rotation, so the Ant's objectives read it as a level torso on the
    ground (not upright) without dividing by zero, and the real steps before it keep their values."""
    env = gym.make("Ant-v5").unwrapped
    env.reset(seed=0)
    real = get_physics_state(env)
    env.close()
    segment = np.stack([real, real, np.zeros_like(real)])[None]  # two real steps, then the padding
    with np.errstate(all="raise"):
        rewards = objectives.ant_raise_leg(None, None, segment)
        raised = objectives.ant_leg_raised_share(None, None, segment)
        height, up = objectives.ant_front_left_foot(segment)
    assert np.isfinite(rewards).all() and np.isfinite(raised).all()
    assert rewards[0, 0] == rewards[0, 1] == pytest.approx(min(height[0, 0], objectives.ANT_FOOT_HEIGHT_PAID))
    assert up[0, 2] == 1.0 and rewards[0, 2] == -1.0  # the padding's torso is at 0 m: not up


def test_example_objective_loads_and_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    objective = objectives.load_objective("my_objective:hop_high")
    assert objective.envs == ("Hopper",) and objective.success is not None
    objectives.check_objective(objective, 11, 3, 13)


class Settings:
    """The few Args fields check_objective_settings reads."""

    def __init__(self, env_id: str, teacher_objective: str, terminate_when_unhealthy: bool = True):
        self.env_id, self.teacher_objective, self.terminate_when_unhealthy = env_id, teacher_objective, terminate_when_unhealthy


def test_backflip_turns_angle_termination_off_and_fall_termination_off_unless_the_command_line_asks_for_it():
    import sac_rlhf

    flags = ["--env-id", "Hopper-v5", "--teacher-objective", "hopper-backflip"]
    args = command_line_args(sac_rlhf.Args, flags)
    assert args.terminate_when_unhealthy is False and args.terminate_when_tilted is False
    # asked for, unhealthy termination stays: episodes end on a fall (height), never on the angle a flip passes through
    args = command_line_args(sac_rlhf.Args, [*flags, "--terminate-when-unhealthy"])
    assert args.terminate_when_unhealthy is True and args.terminate_when_tilted is False
    args = command_line_args(sac_rlhf.Args, [*flags, "--terminate-when-tilted"])
    with pytest.raises(ConfigError, match="needs terminate_when_tilted=False: drop --terminate-when-tilted"):
        sac_rlhf.validate_args(args)


def test_checking_an_objectives_settings_changes_none_of_them():
    """Validation only checks: the objective's needs come in with the defaults the command line is parsed onto."""
    import sac_rlhf

    args = sac_rlhf.Args(env_id="Hopper-v5", teacher_objective="hopper-backflip")  # built by hand: no defaults applied
    before = dataclasses.asdict(args)
    with pytest.raises(ConfigError, match="needs terminate_when_tilted=False"):
        objectives.check_objective_settings(args)
    assert dataclasses.asdict(args) == before


def test_a_users_objective_brings_its_settings_and_defaults(monkeypatch, tmp_path):
    (tmp_path / "tilting.py").write_text(
        "def lean(obs, actions, states):\n"
        "    return obs[..., 0]\n"
        "lean.settings = {'terminate_when_tilted': False}\n"
        "lean.defaults = {'evaluation_episodes': 3}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import sac_rlhf

    flags = ["--env-id", "Hopper-v5", "--teacher-objective", "tilting:lean"]
    args = command_line_args(sac_rlhf.Args, flags)
    assert args.terminate_when_tilted is False and args.evaluation_episodes == 3
    assert command_line_args(sac_rlhf.Args, [*flags, "--evaluation-episodes", "7"]).evaluation_episodes == 7


@pytest.mark.parametrize(
    ("env_id", "name", "message"),
    [
        (
            "Hopper-v5",
            "backflip",
            "is not a built-in objective (known: hopper-backflip, hopper-backflip-upright, hopper-landed-backflip, ant-raise-leg",
        ),
        ("Hopper-v5", "no_such_module_xyz:f", "module no_such_module_xyz does not import (ModuleNotFoundError"),
        ("Hopper-v5", "my_objective:missing", "module my_objective has no function missing"),
        ("Hopper-v5", "my_objective:HOPPER_NQ", "has no function HOPPER_NQ"),
        ("Hopper-v5", "json:dumps", "must take (obs, actions, states)"),
        ("HalfCheetah-v5", "hopper-backflip", "hopper-backflip is for Hopper, not --env-id HalfCheetah-v5"),
        (WINDMILL, "ant-raise-leg", "ant-raise-leg is for Ant, not --env-id " + WINDMILL),
    ],
)
def test_bad_objectives_are_refused_in_one_line(monkeypatch, env_id, name, message):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    with pytest.raises(ConfigError) as error:
        objectives.check_objective_settings(Settings(env_id, name))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_objective_of_the_wrong_shape_is_refused():
    def per_segment(obs, actions, states):
        return states.sum((-1, -2))

    with pytest.raises(ConfigError, match=r"must return per-step rewards of shape \[n, L\]"):
        objectives.check_objective(objectives.Objective("mine:per_segment", per_segment), 3, 1, 4)

    def broken(obs, actions, states):
        return obs[..., 99]

    with pytest.raises(ConfigError, match="fails on .*IndexError"):
        objectives.check_objective(objectives.Objective("mine:broken", broken), 3, 1, 4)


@pytest.mark.parametrize("script", ["sac_rlhf.py", "pref_ppo.py"])
def test_command_line_refuses_an_unknown_objective_with_exit_2(tmp_path, script):
    env = dict(os.environ, MUJOCO_GL="egl", WANDB_MODE="offline")
    command = [sys.executable, str(REPO_ROOT / "framework" / script), "--env-id", "Hopper-v5", "--teacher-objective", "salto"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "salto" in lines[0] and "hopper-backflip" in lines[0], lines


def test_labelling_a_session_is_cheap():
    """The cost the objective adds to a feedback session: 1000 pairs of 50-step Ant segments (the heaviest built-in,
    forward kinematics) in well under a second."""
    import time

    rng = np.random.default_rng(0)
    n, length = 1000, 50
    states = np.zeros((n, 2, length, 1 + 15 + 14))
    states[..., 1 + 3] = 1.0  # identity quaternion
    states[..., 1 + 7 :] = rng.uniform(-1, 1, (n, 2, length, 22))
    segments = {
        "obs_actions": np.zeros((n, 2, length, 105 + 8), np.float32),
        "masks": np.ones((n, 2, length), bool),
        "physics_states": states,
    }
    start = time.perf_counter()
    rewards = objectives.segment_rewards(objectives.OBJECTIVES["ant-raise-leg"], segments, 105)
    assert rewards.shape == (n, 2, length)
    assert time.perf_counter() - start < 2.0


def write_objective_run(root: Path, name: str, returns: list[float], objective: list[float] | None) -> None:
    import json

    from torch.utils.tensorboard import SummaryWriter

    run_dir = root / name
    writer = SummaryWriter(str(run_dir))
    for step, value in enumerate(returns):
        writer.add_scalar("eval/mean_return", value, step * 100)
        if objective is not None:
            writer.add_scalar("eval/objective_return", objective[step], step * 100)
    writer.close()
    summary = {"final_eval_return": returns[-1], "global_step": 100 * (len(returns) - 1)}
    if objective is not None:
        summary["final_objective_return"] = objective[-1]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "args.json").write_text(json.dumps({"seed": 1, "exp_name": name}))


def test_toolbox_compares_the_objective_or_the_return(tmp_path):
    """toolbox/compare.py --metric objective_return compares what the objective measured; the default still compares
    the env's return; a run without the objective is refused in one line."""
    sys.path.insert(0, str(REPO_ROOT / "toolbox"))
    import compare

    write_objective_run(tmp_path / "runs", "flip", [0.0, 0.0, 0.0], [1.0, 5.0, 25.0])
    write_objective_run(tmp_path / "runs", "still", [0.0, 0.0, 0.0], [1.0, 2.0, 3.0])
    write_objective_run(tmp_path / "plain", "plain", [1.0, 2.0, 7.0], None)
    base = dict(bootstrap_reps=50)
    by_objective = compare.main(compare.Args([str(tmp_path / "runs")], out=str(tmp_path / "a"), metric="objective_return", **base))
    groups = {row["group"]: row["final_return"] for row in by_objective["rows"] if row["run"]}
    assert groups == {"flip": 25.0, "still": 3.0}
    by_return = compare.main(compare.Args([str(tmp_path / "runs")], out=str(tmp_path / "b"), **base))
    assert {row["final_return"] for row in by_return["rows"]} == {0.0}
    with pytest.raises(compare.CompareError, match="plain logged no eval/objective_return"):
        compare.main(compare.Args([str(tmp_path / "plain")], out=str(tmp_path / "c"), metric="objective_return", **base))
