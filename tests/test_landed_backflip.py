"""hopper-landed-backflip on real MuJoCo states: the floor contacts it computes are MuJoCo's own, a flip in the air
landed on the foot counts one, a backward roll over the floor and a flip that ends on the torso count none (the old
torso-height counter scores the roll and misses the flip)."""

import mujoco
import numpy as np
import pytest

from cleanrlhf_utils import objectives
from cleanrlhf_utils.cli import command_line_args
from cleanrlhf_utils.envs import get_physics_state, make_env

DT, GRAVITY = objectives.HOPPER_DT, 9.81
PENETRATION = 0.003
"""metres the lowest capsule sinks into the floor where a planted pose touches it (MuJoCo's soft contacts do)"""
STRAIGHT, TUCK = np.zeros(3), np.array([-2.2, -2.2, 0.0])
"""joint angles (thigh, leg, foot): standing straight, and folded at hip and knee in the air"""
FLIGHT_STEPS = 60
"""a flight of 0.49 s: the centre of mass rises 0.29 m (take-off at 2.4 m/s)"""


@pytest.fixture(scope="module")
def hopper():
    env = make_env("Hopper-v5", 0, terminate_when_unhealthy=False)()
    env.reset(seed=0)
    yield env
    env.close()


def lowest_point(qpos: np.ndarray) -> float:
    """Height of the Hopper's lowest capsule surface (metres)."""
    state = np.concatenate([[0.0], qpos, np.zeros(6)])
    return float((objectives.hopper_capsule_ends(state)[..., 1].min(-1) - objectives.HOPPER_RADII).min())


def on_floor(pitch: float, joints: np.ndarray, x: float = 0.0) -> np.ndarray:
    """qpos of a pose whose lowest point is PENETRATION into the floor."""
    qpos = np.array([x, 0.0, pitch, *joints])
    qpos[1] = -lowest_point(qpos) - PENETRATION
    return qpos


def centre_of_mass(env, qpos: np.ndarray) -> np.ndarray:
    """The whole Hopper's centre of mass (x, z), from MuJoCo."""
    env.unwrapped.set_state(qpos, np.zeros(6))
    return env.unwrapped.data.subtree_com[env.unwrapped.model.body("torso").id][[0, 2]].copy()


def flight(env, turn: float, steps: int = FLIGHT_STEPS, before: int = 10, after: int = 30) -> np.ndarray:
    """qpos rows of a jump: standing upright on the foot, then a flight in which the centre of mass follows the
    parabola of a take-off at 2.4 m/s (back to its take-off height after `steps` + 1 steps) while the body folds and
    unfolds and turns backwards at a steady rate, `turn` radians by then; from the first step any geom touches the
    floor on the way down (the landing), the pose settles there and stays for `after` steps."""
    start = on_floor(0.0, STRAIGHT)
    rows = [start] * before
    com = centre_of_mass(env, start)
    duration = (steps + 1) * DT
    climb = GRAVITY * duration / 2
    step = 0
    while True:
        step += 1
        phase = step / (steps + 1)
        joints = TUCK * np.sin(np.pi * min(phase, 1.0)) ** 0.5
        qpos = np.array([0.0, 0.0, -turn * phase, *joints])
        t = step * DT
        target = com + [0.0, climb * t - GRAVITY * t * t / 2]
        qpos[:2] = target - (centre_of_mass(env, qpos) - qpos[:2])
        coming_down = phase > 0.5  # (on the way up the heel may brush the floor as the body starts turning)
        if coming_down and lowest_point(qpos) < objectives.HOPPER_CONTACT_MARGIN:  # touched down: settle in this pose
            rows += [on_floor(qpos[2], joints, qpos[0])] * after
            return np.array(rows)
        rows.append(qpos)


def backward_rolls(rolls: int, steps_per_roll: int = 120, stand: int = 10) -> np.ndarray:
    """qpos rows: standing upright, then `rolls` backward rolls over the floor (its lowest point always touching it),
    folding at the hip (2.5 rad) and knee (0.5 rad) and unfolding again each turn, then standing."""
    rows = [on_floor(0.0, STRAIGHT)] * stand
    for progress in np.arange(1, rolls * steps_per_roll + 1) / steps_per_roll:
        rows.append(on_floor(-2 * np.pi * progress, np.array([-2.5, -0.5, 0.0]) * np.sin(np.pi * (progress % 1)) ** 0.5))
    return np.array(rows + [rows[-1]] * stand)


def simulated(env, qpos_rows: np.ndarray) -> tuple[np.ndarray, list[set[str]]]:
    """The real env's full-physics states of the qpos rows (velocities by finite differences), and the Hopper geoms
    MuJoCo's own contact list has touching the floor in each."""
    model, data = env.unwrapped.model, env.unwrapped.data
    floor = model.geom("floor").id
    states, touching = [], []
    for qpos, qvel in zip(qpos_rows, np.gradient(qpos_rows, DT, axis=0)):
        env.unwrapped.set_state(qpos, qvel)
        states.append(get_physics_state(env))
        pairs = [(contact.geom1, contact.geom2) for contact in data.contact[: data.ncon]]
        touching.append({model.geom(a + b - floor).name.removesuffix("_geom") for a, b in pairs if floor in (a, b)})
    return np.asarray(states), touching


def counts(states: np.ndarray) -> tuple[float, float]:
    """(landed backflips, the old torso-height counter's backflips) of one episode's states."""
    return objectives.hopper_landed_backflips(None, None, states[None])[0], objectives.hopper_backflips(None, None, states[None])[0]


def test_floor_contacts_are_mujocos(hopper):
    """Planar forward kinematics gives each capsule's ends as MuJoCo places them, and a capsule touches the floor in
    exactly the states where MuJoCo's contact list (after mj_forward) pairs it with the floor: 600 random poses,
    heights from under the floor to above it, every geom touching in some and not in others."""
    model, data = hopper.unwrapped.model, hopper.unwrapped.data
    rng = np.random.default_rng(0)
    states, theirs = [], []
    for _ in range(600):
        data.qpos[:] = [rng.uniform(-5, 5), rng.uniform(-0.2, 1.6), rng.uniform(-10, 10), *rng.uniform([-2.6, -2.6, -0.8], [0, 0, 0.8])]
        data.qvel[:] = rng.normal(size=6)
        mujoco.mj_forward(model, data)
        states.append(get_physics_state(hopper))
        pairs = {frozenset((contact.geom1, contact.geom2)) for contact in data.contact[: data.ncon]}
        theirs.append([frozenset((model.geom("floor").id, model.geom(f"{name}_geom").id)) in pairs for name in objectives.HOPPER_GEOMS])
        ends = objectives.hopper_capsule_ends(states[-1])
        for index, name in enumerate(objectives.HOPPER_GEOMS):
            geom = model.geom(f"{name}_geom").id
            axis = data.geom_xmat[geom].reshape(3, 3)[:, 2] * model.geom_size[geom][1]
            mujocos = np.stack([data.geom_xpos[geom] + axis, data.geom_xpos[geom] - axis])[:, [0, 2]]
            assert min(np.abs(mujocos - ends[index]).max(), np.abs(mujocos[::-1] - ends[index]).max()) < 1e-9
    theirs = np.array(theirs)
    assert 0 < theirs.sum(0).min() and theirs.sum(0).max() < len(theirs)
    assert np.array_equal(objectives.hopper_floor_contacts(np.asarray(states)), theirs)


def take_off_and_landing(touching: list[set[str]]) -> tuple[int, int]:
    """The steps before and after the one run of steps in which MuJoCo has nothing touching the floor."""
    airborne = [step for step, geoms in enumerate(touching) if not geoms]
    assert airborne == list(range(airborne[0], airborne[-1] + 1))
    return airborne[0] - 1, airborne[-1] + 1


def test_a_flip_in_the_air_landed_on_the_foot_counts_one(hopper):
    """Take-off from the foot, 58 steps with nothing touching the floor, landing on the foot 0.29 rad past upright
    (2 pi + 0.18 turned between take-off and landing), standing on after: one landed backflip, and the objective's
    reward over the flight is the turn up to one full circle from the start's upright pitch (turning on past it pays
    nothing), standing before the jump costs the waiting cost and standing after it earns the landed bonus. The old counter misses
    it: upside down in the air the torso is below 0.7 m."""
    states, touching = simulated(hopper, flight(hopper, 2 * np.pi + 0.4))
    take_off, landing = take_off_and_landing(touching)
    assert touching[take_off] == {"foot"} and all(geoms == {"foot"} for geoms in touching[landing:])
    pitch = states[:, 1 + objectives.HOPPER_PITCH]
    assert 2 * np.pi < pitch[take_off] - pitch[landing] and abs(objectives.hopper_tilt(states[landing])) < 0.5
    assert counts(states) == (1.0, 0.0)
    rewards = objectives.hopper_landed_backflip(None, None, states[None])[0]
    waiting = objectives.HOPPER_WAITING_COST * (pitch[take_off + 1 : landing] > -2 * np.pi + objectives.HOPPER_LANDING_TILT).sum()
    assert rewards[take_off + 1 : landing].sum() == pytest.approx(pitch[take_off + 1] + 2 * np.pi - waiting, abs=0.13)
    past_the_circle = np.arange(len(states)) < landing
    past_the_circle &= pitch < -2 * np.pi
    assert past_the_circle.any() and (rewards[past_the_circle] <= 0).all()
    assert np.allclose(rewards[:take_off], -objectives.HOPPER_WAITING_COST) and np.allclose(
        rewards[landing:], objectives.HOPPER_LANDED_BONUS
    )
    assert not objectives.hopper_body_on_floor(states).any()  # the episode goes on


def test_turning_short_of_a_full_turn_between_take_off_and_landing_counts_nothing(hopper):
    """The same jump turning 2 pi + 0.2 in all, 2 pi - 0.01 of it between take-off and landing (the rest on the
    floor before and after): no backflip, however upright the landing."""
    states, touching = simulated(hopper, flight(hopper, 2 * np.pi + 0.2))
    take_off, landing = take_off_and_landing(touching)
    assert touching[take_off] == touching[landing] == {"foot"} and abs(objectives.hopper_tilt(states[landing])) < 0.5
    pitch = states[:, 1 + objectives.HOPPER_PITCH]
    assert 2 * np.pi - 0.02 < pitch[take_off] - pitch[landing] < 2 * np.pi
    assert counts(states) == (0.0, 0.0)


def test_a_backward_roll_over_the_floor_counts_nothing(hopper):
    """Two backward rolls, some part of the Hopper on the floor at every step (MuJoCo's contacts), the torso above
    0.7 m in the first and last part of each turn: no landed backflip, and the objective pays nothing up to where the
    torso, thigh or leg first touches the floor (MuJoCo's contacts), where its episode ends. The old counter counts one
    flip and pays for the roll."""
    states, touching = simulated(hopper, backward_rolls(2))
    assert all(touching) and any("torso" in geoms for geoms in touching)
    assert counts(states) == (0.0, 1.0)
    ends = objectives.hopper_body_on_floor(states)
    assert np.array_equal(ends, [bool(geoms - {"foot"}) for geoms in touching]) and ends.any() and not ends[0]
    rewards = objectives.hopper_landed_backflip(None, None, states[None])[0]
    assert rewards[: ends.argmax() + 1].max() < 0 and objectives.hopper_backflip(None, None, states[None]).sum() > 0
    # Standing after the rolls would earn the landed bonus: the end of the episode is what keeps a roll from paying.
    assert rewards[-1] == objectives.HOPPER_LANDED_BONUS


@pytest.mark.parametrize(
    ("turn", "lands_on"),
    [(2 * np.pi + 1.6, "torso"), (2 * np.pi + 1.2, "foot")],
    ids=["on-the-torso", "on-the-foot-tilted"],
)
def test_a_flip_that_ends_on_the_torso_or_tilted_counts_nothing(hopper, turn, lands_on):
    """The jump turning faster, more than 2 pi between take-off and landing: 2 pi + 1.6 comes down on its back, the
    torso touching the floor first (the old counter counts it); 2 pi + 1.2 lands on the foot tilted back 0.83 rad,
    past 0.5. Neither counts."""
    states, touching = simulated(hopper, flight(hopper, turn))
    take_off, landing = take_off_and_landing(touching)
    pitch = states[:, 1 + objectives.HOPPER_PITCH]
    assert touching[take_off] == {"foot"} and lands_on in touching[landing] and pitch[take_off] - pitch[landing] > 2 * np.pi
    assert counts(states)[0] == 0.0


def test_the_objective_runs_with_no_termination_and_counts_landed_flips():
    import sac

    args = command_line_args(sac.Args, ["--env-id", "Hopper-v5", "--reward-objective", "hopper-landed-backflip"])
    objective = objectives.check_objective_settings(args, "reward_objective")
    assert args.terminate_when_unhealthy is False and args.terminate_when_tilted is False
    assert objective.success is objectives.hopper_landed_backflips


@pytest.mark.parametrize(("pose", "ends"), [("standing", False), ("upside down on its torso", True)])
def test_an_episode_of_the_objective_ends_when_anything_but_the_foot_touches_the_floor(pose, ends):
    """The env a run on hopper-landed-backflip makes (its settings, the objective's end of an episode), stepped by
    real MuJoCo from a standing pose and from one upside down on its torso: only the second step ends the episode, as
    terminated (a crash, not a time limit)."""
    import sac

    args = command_line_args(sac.Args, ["--env-id", "Hopper-v5", "--reward-objective", "hopper-landed-backflip"])
    env = sac.make_vector_env(args).envs[0]
    env.reset(seed=0)
    qpos = on_floor(0.0 if pose == "standing" else np.pi, STRAIGHT)
    env.unwrapped.set_state(qpos, np.zeros(6))
    _, _, terminated, truncated, _ = env.step(np.zeros(3))
    assert (terminated, truncated) == (ends, False)
    env.close()


def test_an_objectives_own_end_of_an_episode_is_read_from_the_function(tmp_path, monkeypatch):
    """A module:function objective brings its end of an episode as an attribute, like success; one that is not a
    function is refused in one line naming it."""
    (tmp_path / "my_flip.py").write_text(
        "from cleanrlhf_utils import objectives\n"
        "def flip(obs, actions, states):\n    return objectives.hopper_landed_backflip(obs, actions, states)\n"
        "flip.ends_episode = objectives.hopper_body_on_floor\n"
        "def bad(obs, actions, states):\n    return flip(obs, actions, states)\n"
        "bad.ends_episode = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert objectives.load_objective("my_flip:flip").ends_episode is objectives.hopper_body_on_floor
    with pytest.raises(objectives.ConfigError, match=r"my_flip:bad: bad.ends_episode must be a function of a state"):
        objectives.load_objective("my_flip:bad")
