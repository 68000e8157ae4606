"""Objectives: what the synthetic teacher prefers instead of the environment's reward (`--teacher-objective NAME`).

Preference-based RL exists for behaviours nobody writes a reward for: a Hopper backflip, an Ant holding one leg up, a
windmill turned one way. An objective is the simulated person's intent: the synthetic teacher labels a pair by the
objective's (discounted) segment return, with the same beta/gamma/eps noise model it applies to the env's reward;
every evaluation also measures it (eval/objective_return, eval/objective_success) and summary.json carries it. In
human mode an objective is only measured, never used for labels.

The data of this module, one owner: OBJECTIVES (name -> Objective). Each built-in's docstring says what it rewards and
how its success is counted.

Your own objective: `--teacher-objective my_module:my_function`, where my_module is importable (on PYTHONPATH or
installed) and

    def my_function(obs, actions, states) -> rewards
        obs:     float array [n_segments, segment_len, obs_dim]     observations (the one each action was taken in)
        actions: float array [n_segments, segment_len, action_dim]  actions
        states:  float array [n_segments, segment_len, state_dim]   simulator state behind each observation (MuJoCo:
                 mj_getState's mjSTATE_FULLPHYSICS, i.e. [time, qpos, qvel, act, ...]; width 0 for envs without one)
        returns: float array [n_segments, segment_len], the objective's reward of every step

It must be vectorised over segments and steps (numpy on whole arrays: it labels thousands of segments at once) and
must not depend on which steps are masked (masked steps' rewards are zeroed after it). Optional attributes on the
function: `success(obs, actions, states) -> [n]` (one value per episode, given whole episodes [n, T + 1, ...] with
the final observation and a zero action appended: evaluation logs its mean as eval/objective_success), `measures`
({name: function like success}: further per-episode measures, logged as eval/objective_<name>), `ends_episode`
(state [state_dim] -> bool: the episode ends, terminated, in a state where the behaviour has failed for good), `envs` (a
tuple of env names without version, e.g. ("Hopper",): any other env is refused), `settings` ({Args field: value}
the run needs; a command line that contradicts one is refused) and `defaults` ({Args field: value} the run takes
unless the command line sets that field). examples/objectives/my_objective.py is a complete example.
"""

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .errors import ConfigError, need

Array = np.ndarray


@dataclass(frozen=True)
class Objective:
    name: str
    """the --teacher-objective value that chose it"""
    reward: Callable[[Array, Array, Array], Array]
    """(obs, actions, states) [n, L, ...] -> per-step reward [n, L]"""
    success: Callable[[Array, Array, Array], Array] | None = None
    """whole episodes [n, T + 1, ...] -> success measure [n]; None: the objective has none"""
    envs: tuple[str, ...] = ()
    """env names (registry id without version and module) it applies to; empty: any env"""
    settings: dict = field(default_factory=dict)
    """Args field -> value the behaviour needs (set; a command line that contradicts it is refused)"""
    defaults: dict = field(default_factory=dict)
    """Args field -> value the behaviour runs with unless the command line says otherwise"""
    measures: dict[str, Callable[[Array, Array, Array], Array]] = field(default_factory=dict)
    """name -> further per-episode measure (called as success is), reported beside success in every evaluation"""
    ends_episode: Callable[[Array], Array] | None = None
    """simulator state [state_dim] -> whether the behaviour has failed for good there: the env ends the episode
    (terminated) in every run that trains on or is taught the objective, and in its evaluations. None: the env's own ends"""

    @property
    def description(self) -> str:
        return inspect.getdoc(self.reward) or ""


# ----------------------------------------------------------------------------------------
# MuJoCo full-physics state layout: [time, qpos (nq), qvel (nv), ...]
# ----------------------------------------------------------------------------------------
def qpos(states: Array, nq: int) -> Array:
    return states[..., 1 : 1 + nq]


def qvel(states: Array, nq: int, nv: int) -> Array:
    return states[..., 1 + nq : 1 + nq + nv]


# --- Hopper: qpos = [x, z, pitch, thigh, leg, foot] (nq = nv = 6) ---
HOPPER_NQ = 6
HOPPER_PITCH = 2
"""the torso's rooty angle: MuJoCo keeps a hinge's angle unwrapped; positive pitches forward, a backflip turns it by -2 pi"""
HOPPER_DT = 0.008
"""seconds per env step of Gymnasium's Hopper (frame_skip 4 x timestep 0.002)"""


HOPPER_Z = 1
HOPPER_MIN_HEIGHT = 0.7
"""rotation counts only while the torso is at least this high (m; Gymnasium's own healthy height for Hopper): with
termination off, a fallen Hopper rolling over on the ground would otherwise score as flipping"""


def hopper_torso_up(states: Array) -> Array:
    """Whether the torso is at least HOPPER_MIN_HEIGHT above the ground, per state [...]."""
    return qpos(states, HOPPER_NQ)[..., HOPPER_Z] >= HOPPER_MIN_HEIGHT


def hopper_backward_turn(states: Array) -> Array:
    """Radians the torso turns backwards over each step [...] (-d pitch/dt x dt)."""
    return -qvel(states, HOPPER_NQ, HOPPER_NQ)[..., HOPPER_PITCH] * HOPPER_DT


def hopper_backward_turns(states: Array) -> Array:
    """Radians the torso turned backwards over each step [n, L] (-d pitch/dt x dt), counted only while it is at least
    HOPPER_MIN_HEIGHT above the ground."""
    return hopper_backward_turn(states) * hopper_torso_up(states)


def hopper_backflip(obs: Array, actions: Array, states: Array) -> Array:
    """Backward rotation of the Hopper's torso in the air: each step's reward is the backward rotation over the step
    (radians, -d pitch/dt x dt) while the torso is at least 0.7 m high (0 below: rolling on the ground is no backflip),
    so a return is how far the torso turned backwards up there (2 pi per backflip). Success: completed backflips per
    episode, floor(max(0, net backward turn up there) / 2 pi), the turn summed from the unwrapped pitch angle's change
    over the steps that start at that height. Needs --no-terminate-when-tilted (set for you): Gymnasium's Hopper ends
    an episode once the torso tilts by 0.2 rad. Episodes do not end on a fall either, unless --terminate-when-unhealthy
    is given: then they end when the torso drops below 0.7 m. A roll over the floor scores too, where the torso is up
    before and after it; evaluations report landed_backflips (hopper-landed-backflip's success) beside the count."""
    return hopper_backward_turns(states)


HOPPER_UPRIGHT_BONUS = 0.005
"""radians' worth of reward per step with the torso at least HOPPER_MIN_HEIGHT high: 5 over a 1000-step episode, about
what throwing the Hopper backwards and falling earns (the fall-ending runs learned that: about 5 rad), so neither
standing still nor the throw wins alone, and a flip that lands earns both"""


def hopper_backflip_upright(obs: Array, actions: Array, states: Array) -> Array:
    """Backflips that land: hopper-backflip's reward (radians turned backwards while the torso is at least 0.7 m high)
    plus 0.005 per step at that height, so a Hopper that survives its flip earns more than one that falls after it.
    Success: completed backflips per episode, counted as for hopper-backflip. Runs where a fall ends the episode
    (--terminate-when-unhealthy, set for you unless the command line says --no-terminate-when-unhealthy), and needs
    --no-terminate-when-tilted (set for you)."""
    return hopper_backward_turns(states) + HOPPER_UPRIGHT_BONUS * hopper_torso_up(states)


def hopper_backflips(obs: Array, actions: Array, states: Array) -> Array:
    pitch = qpos(states, HOPPER_NQ)[..., HOPPER_PITCH]
    up = hopper_torso_up(states[:, :-1])
    backward = ((pitch[:, :-1] - pitch[:, 1:]) * up).sum(1)  # the unwrapped angle's change, where the step starts up
    return np.floor(np.maximum(0.0, backward) / (2 * np.pi))


# --- Hopper's contacts with the floor, from the state alone ---
# Gymnasium's Hopper is planar: the torso's centre at (rootx, rootz), turned by rooty about +y; the thigh, leg and
# foot hinges turn about -y, each at the end of the previous segment. A hinge angle a about +y maps a local (x, z) to
# (x cos a + z sin a, -x sin a + z cos a).
HOPPER_GEOMS = ("torso", "thigh", "leg", "foot")
"""the Hopper's capsules, in the order hopper_capsule_ends and hopper_floor_contacts give them"""
HOPPER_RADII = np.array([0.05, 0.05, 0.04, 0.06])
"""metres: the capsules' radii in Gymnasium's hopper.xml"""
HOPPER_CONTACT_MARGIN = 0.001
"""metres: hopper.xml's geom margin; MuJoCo lists a contact once a capsule end's sphere is nearer the floor than it"""


def _along(angle: Array, x: float, z: float) -> Array:
    """A segment's local offset (x, z) in the world frame [..., 2], for a segment turned by `angle` about +y."""
    cos, sin = np.cos(angle), np.sin(angle)
    return np.stack([x * cos + z * sin, -x * sin + z * cos], -1)


def hopper_capsule_ends(states: Array) -> Array:
    """The two ends of the axis of each Hopper capsule, in the world's (x, z) [..., 4 (HOPPER_GEOMS), 2, 2]: planar
    forward kinematics of Gymnasium's hopper.xml. Matches MuJoCo's geom positions to float precision."""
    x, z, pitch, thigh, leg, foot = np.moveaxis(qpos(states, HOPPER_NQ), -1, 0)
    centre = np.stack([x, z], -1)
    hip = centre + _along(pitch, 0.0, -0.2)
    thigh_angle = pitch - thigh
    knee = hip + _along(thigh_angle, 0.0, -0.45)
    leg_angle = thigh_angle - leg
    ankle = knee + _along(leg_angle, 0.0, -0.5)
    foot_angle = leg_angle - foot
    heel, toe = ankle + _along(foot_angle, -0.13, 0.0), ankle + _along(foot_angle, 0.26, 0.0)
    ends = [(centre + _along(pitch, 0.0, 0.2), hip), (hip, knee), (knee, ankle), (heel, toe)]
    return np.stack([np.stack(pair, -2) for pair in ends], -3)


def hopper_floor_contacts(states: Array) -> Array:
    """Which Hopper capsules touch the floor [..., 4 (HOPPER_GEOMS)], exactly when MuJoCo lists a contact between
    that geom and the floor (a capsule end within the margin of it; the floor plane is z = 0 and unbounded)."""
    lowest = hopper_capsule_ends(states)[..., 1].min(-1)
    return lowest - HOPPER_RADII < HOPPER_CONTACT_MARGIN


HOPPER_LANDING_TILT = 0.5
"""radians: a landing counts with the torso at most this far from upright (wrapped to [-pi, pi))"""
HOPPER_LANDING_HOLD = 25
"""steps (0.2 s) after a landing in which no body part but the foot may touch the floor"""


def hopper_tilt(states: Array) -> Array:
    """The torso's angle from upright, wrapped to [-pi, pi) [...] (the unwrapped pitch counts whole turns)."""
    pitch = qpos(states, HOPPER_NQ)[..., HOPPER_PITCH]
    return (pitch + np.pi) % (2 * np.pi) - np.pi


def hopper_landed_backflips(obs: Array, actions: Array, states: Array) -> Array:
    """Landed backflips per episode [n], from whole episodes' states [n, T + 1, ...]. A flight is a run of steps in
    which no Hopper geom touches the floor (MuJoCo's contacts, from hopper_floor_contacts); its take-off is the step
    before it, its landing the step after it. A flight scores floor(turn / 2 pi) backflips, the turn being the
    unwrapped pitch at take-off minus that at landing (backwards positive), when the take-off and the landing touch
    the floor with the foot alone, the torso at landing is at most HOPPER_LANDING_TILT (0.5 rad) from upright, and no
    geom but the foot touches the floor in the HOPPER_LANDING_HOLD (25) steps after the landing (fewer where the
    episode ends first). So a roll over the floor, a flip that ends on the torso, on the knee, or tilted, and a flight
    the episode starts or ends in count nothing."""
    contacts = hopper_floor_contacts(states)
    foot, body = contacts[..., 3], contacts[..., :3].any(-1)
    pitch = qpos(states, HOPPER_NQ)[..., HOPPER_PITCH]
    length = states.shape[1]
    edges = np.diff(np.pad(~(foot | body), ((0, 0), (1, 1))).astype(np.int8), axis=1)
    rows, first_airborne = np.nonzero(edges == 1)
    _, landing = np.nonzero(edges == -1)  # flights alternate with contact in each row: the k-th end closes the k-th start
    take_off = first_airborne - 1
    complete = (take_off >= 0) & (landing < length)
    take_off, landing = np.clip(take_off, 0, length - 1), np.clip(landing, 0, length - 1)
    body_so_far = np.pad(np.cumsum(body, axis=1), ((0, 0), (1, 0)))  # [n, T + 2]: body contacts before each step
    hold_end = np.minimum(landing + 1 + HOPPER_LANDING_HOLD, length)
    held = body_so_far[rows, hold_end] == body_so_far[rows, landing]
    on_foot = foot[rows, take_off] & ~body[rows, take_off] & foot[rows, landing] & held
    upright = np.abs(hopper_tilt(states[rows, landing])) <= HOPPER_LANDING_TILT
    turns = np.floor(np.maximum(0.0, pitch[rows, take_off] - pitch[rows, landing]) / (2 * np.pi))
    return np.bincount(rows, weights=turns * (complete & on_foot & upright), minlength=len(states)).astype(np.float64)


HOPPER_LANDED_BONUS = 0.1
"""reward per step standing on the foot, upright, after a full backward turn: about 10 over the discounted horizon,
more than the turn itself earns, so a flip that lands is worth about twice one that crashes"""
HOPPER_WAITING_COST = 0.05
"""reward per step (minus) before the first full backward turn: a crash ends the episode, so without a cost standing
still until the time limit outbids a flip that may crash (SAC did so by 70k steps; with this cost one seed of two still
stands: docs/benchmarks/backflip.md)"""
HOPPER_FLIPS_PAID = 1
"""full backward turns (from the start's upright pitch) whose rotation in the air pays: turning on past them earns
nothing, so over-rotating into a crash gains nothing over landing"""


def hopper_body_on_floor(state: Array) -> Array:
    """Whether the Hopper's torso, thigh or leg touches the floor [...] (hopper-landed-backflip's end of an episode)."""
    return hopper_floor_contacts(state)[..., :3].any(-1)


def hopper_landed_backflip(obs: Array, actions: Array, states: Array) -> Array:
    """Backflips that land on the foot: each step's reward is the torso's backward rotation over the step (radians,
    -d pitch/dt x dt) while no part of the Hopper touches the floor and the torso has not yet turned one full circle
    backwards (unwrapped pitch above -2 pi), and its forward rotation (minus) at any time, so only a turn in the air
    pays, once, and rocking back and forth nets nothing; plus 0.1 per step standing on the foot alone within 0.5 rad
    of upright after a full backward turn (unwrapped pitch at most -2 pi + 0.5), and minus 0.05 per step before that
    turn: waiting costs, a flip that lands pays on. The episode ends when the torso, thigh or leg touches the floor,
    so a roll over the floor cannot turn the Hopper round, and a crashed landing ends the episode with the turn's
    reward alone. Success: landed backflips per
    episode (hopper_landed_backflips: a turn of at least 2 pi between a take-off from the foot and a landing on it,
    upright, with nothing but the foot touching the floor for 0.2 s after). Needs --no-terminate-when-unhealthy and
    --no-terminate-when-tilted (set for you): upside down in the air the torso is below Gymnasium's healthy height.
    Evaluations report torso_high_backflips (hopper-backflip's count) beside it."""
    contacts = hopper_floor_contacts(states)
    body = contacts[..., :3].any(-1)
    airborne = ~(body | contacts[..., 3])
    pitch = qpos(states, HOPPER_NQ)[..., HOPPER_PITCH]
    turned = pitch <= -2 * np.pi + HOPPER_LANDING_TILT
    landed = contacts[..., 3] & ~body & turned & (np.abs(hopper_tilt(states)) <= HOPPER_LANDING_TILT)
    turn = hopper_backward_turn(states)
    paid = airborne & (pitch > -2 * np.pi * HOPPER_FLIPS_PAID)
    return np.where(paid, turn, np.minimum(turn, 0.0)) + HOPPER_LANDED_BONUS * landed - HOPPER_WAITING_COST * ~turned


# --- HalfCheetah: qpos = [x, z, pitch, 6 joints] (nq = 9), qvel[0] = forward velocity ---
def halfcheetah_backward(obs: Array, actions: Array, states: Array) -> Array:
    """Running backwards: each step's reward is the HalfCheetah's backward velocity (m/s, -dx/dt), no control cost.
    Success: the mean backward speed over the episode (m/s; the env's forward runners score negative)."""
    return -qvel(states, 9, 9)[..., 0]


def halfcheetah_backward_speed(obs: Array, actions: Array, states: Array) -> Array:
    return halfcheetah_backward(obs, actions, states)[:, :-1].mean(1)


# --- Ant: qpos = [x, y, z, quaternion (w, x, y, z), hip_1, ankle_1, ..., hip_4, ankle_4] (nq = 15) ---
ANT_NQ = 15
ANT_FOOT_HEIGHT = 0.5
"""metres: the raised foot's tip counts as high above this"""


def _rotation(axis, angle: Array) -> Array:
    """Rotation matrices [..., 3, 3] about a fixed axis by angles [...] (Rodrigues)."""
    x, y, z = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    k = np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])
    c, s = np.cos(angle)[..., None, None], np.sin(angle)[..., None, None]
    return np.eye(3) + s * k + (1 - c) * (k @ k)


def _quaternion_matrix(q: Array) -> Array:
    """Rotation matrices [..., 3, 3] of quaternions [..., 4] (w, x, y, z). A zero quaternion (a masked step's zero
    state past a segment's episode end, or check_objective's probe) is read as no rotation, not divided by."""
    norm = np.linalg.norm(q, axis=-1, keepdims=True)
    w, x, y, z = np.moveaxis(q / np.where(norm > 0, norm, 1.0), -1, 0)
    rows = (
        (1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)),
        (2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)),
        (2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)),
    )
    return np.stack([np.stack(row, -1) for row in rows], -2)


def ant_front_left_foot(states: Array) -> tuple[Array, Array]:
    """Forward kinematics of Gymnasium's Ant, vectorised: the front-left foot's tip height [...] and the torso's
    up-vector z component [...] (1 upright, -1 upside down). Matches MuJoCo's geom positions to float precision."""
    q = qpos(states, ANT_NQ)
    rotation = _quaternion_matrix(q[..., 3:7])
    hip, ankle = q[..., 7], q[..., 8]
    link = np.array([0.2, 0.2, 0.0])
    foot = _rotation([-1, 1, 0], ankle) @ np.array([0.4, 0.4, 0.0])
    local = link + np.einsum("...ij,...j->...i", _rotation([0, 0, 1], hip), link + foot)
    tip = q[..., :3] + np.einsum("...ij,...j->...i", rotation, local)
    return tip[..., 2], rotation[..., 2, 2]


ANT_UPRIGHT = 0.5
"""the torso's up-vector z component above which the Ant counts as upright (60 degrees of tilt at most)"""
ANT_MIN_TORSO_HEIGHT = 0.3
"""metres: the torso's height above which the Ant counts as up"""
ANT_EPISODE_STEPS = 1000
"""Gymnasium's Ant time limit: the share of steps with the foot up is over all of them, so ending early scores less"""


def ant_upright(states: Array) -> Array:
    """Whether the Ant's torso is upright (up-vector z > 0.5) and up (higher than 0.3 m) [...]."""
    _, up = ant_front_left_foot(states)
    return (up > ANT_UPRIGHT) & (qpos(states, ANT_NQ)[..., 2] > ANT_MIN_TORSO_HEIGHT)


def ant_tipped_over(state: Array) -> Array:
    """ant-raise-leg's end of an episode: the torso tilted past 60 degrees or down below 0.3 m [...]."""
    return ~ant_upright(state)


ANT_FOOT_HEIGHT_PAID = ANT_FOOT_HEIGHT + 0.1
"""metres: ant-raise-leg pays the foot's height up to here: higher needs the Ant to lean further back from the raised
leg, which tipped it over (SAC on the uncapped height held the foot up half of an episode, ending early in 6 of 10)"""


def ant_raise_leg(obs: Array, actions: Array, states: Array) -> Array:
    """The Ant holds its front-left foot high while its torso stays up: each step's reward is the foot tip's height
    (metres, paid up to ANT_FOOT_HEIGHT_PAID) while the torso is upright (up-vector z > 0.5 and torso height > 0.3 m),
    else -1; the episode ends once the torso is not upright (a tipped-over Ant cannot right itself, and its foot height
    means nothing). Success: the share of the 1000 steps of a full episode with the foot above 0.5 m and the torso
    upright. With the torso level, the foot tip is at most 0.28 m below the torso's centre (hip and ankle ranges of
    Gymnasium's ant.xml), so 0.5 m needs the Ant up on its other legs and leaning back from the raised one."""
    height, _ = ant_front_left_foot(states)
    return np.where(ant_upright(states), np.minimum(height, ANT_FOOT_HEIGHT_PAID), -1.0)


def ant_leg_raised_share(obs: Array, actions: Array, states: Array) -> Array:
    height, _ = ant_front_left_foot(states)
    raised = (height > ANT_FOOT_HEIGHT) & ant_upright(states)
    return raised[:, :-1].sum(1) / ANT_EPISODE_STEPS


# --- the example windmill (cleanrlhf_utils.example_envs.windmill): qpos = [angle], qvel = [angular velocity] ---
WINDMILL_DT = 0.04
"""seconds per env step of the windmill (frame_skip 4 x timestep 0.01)"""


def windmill_clockwise(obs: Array, actions: Array, states: Array) -> Array:
    """The windmill's rotor turning clockwise (as the camera sees it): each step's reward is its clockwise angular
    velocity times the step's duration (radians turned clockwise). Success: the share of the episode's steps turning clockwise (angular velocity > 0.1 rad/s)."""
    return qvel(states, 1, 1)[..., 0] * WINDMILL_DT


def windmill_counterclockwise(obs: Array, actions: Array, states: Array) -> Array:
    """The windmill's rotor turning counter-clockwise (as the camera sees it): each step's reward is its
    counter-clockwise angular velocity times the step's duration (radians turned counter-clockwise). Success: the share of the episode's steps turning counter-clockwise
    (angular velocity < -0.1 rad/s)."""
    return -qvel(states, 1, 1)[..., 0] * WINDMILL_DT


def _turning_share(direction: float) -> Callable[[Array, Array, Array], Array]:
    def share(obs: Array, actions: Array, states: Array) -> Array:
        return (direction * qvel(states, 1, 1)[..., 0] > 0.1)[:, :-1].mean(1)

    return share


OBJECTIVES: dict[str, Objective] = {
    "hopper-backflip": Objective(
        "hopper-backflip",
        hopper_backflip,
        hopper_backflips,
        ("Hopper",),
        {"terminate_when_tilted": False},
        {"terminate_when_unhealthy": False},
        {"landed_backflips": hopper_landed_backflips},
    ),
    "hopper-backflip-upright": Objective(
        "hopper-backflip-upright",
        hopper_backflip_upright,
        hopper_backflips,
        ("Hopper",),
        {"terminate_when_tilted": False},
        {"terminate_when_unhealthy": True},
        {"landed_backflips": hopper_landed_backflips},
    ),
    "hopper-landed-backflip": Objective(
        "hopper-landed-backflip",
        hopper_landed_backflip,
        hopper_landed_backflips,
        ("Hopper",),
        {"terminate_when_unhealthy": False, "terminate_when_tilted": False},
        {},
        {"torso_high_backflips": hopper_backflips},
        hopper_body_on_floor,
    ),
    "ant-raise-leg": Objective("ant-raise-leg", ant_raise_leg, ant_leg_raised_share, ("Ant",), ends_episode=ant_tipped_over),
    "halfcheetah-backward": Objective("halfcheetah-backward", halfcheetah_backward, halfcheetah_backward_speed, ("HalfCheetah",)),
    "windmill-clockwise": Objective("windmill-clockwise", windmill_clockwise, _turning_share(1.0), ("Windmill",)),
    "windmill-counterclockwise": Objective("windmill-counterclockwise", windmill_counterclockwise, _turning_share(-1.0), ("Windmill",)),
}


# ----------------------------------------------------------------------------------------
# Resolving --teacher-objective
# ----------------------------------------------------------------------------------------
def load_objective(name: str, flag: str = "--teacher-objective") -> Objective | None:
    """The objective `flag` names (None: the env's own reward), or ConfigError in one line."""
    if not name:
        return None
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    if ":" not in name:
        raise ConfigError(f"{flag} {name} is not a built-in objective (known: {', '.join(OBJECTIVES)}) nor module:function")
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 (the user's module: any failure is said in one line)
        raise ConfigError(f"{flag} {name}: module {module_name} does not import ({type(error).__name__}: {error})") from None
    function = getattr(module, function_name, None)
    need(callable(function), f"{flag} {name}: module {module_name} has no function {function_name}")
    try:
        inspect.signature(function).bind(None, None, None)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {name}: {function_name} must take (obs, actions, states) and return per-step rewards [n, L]") from None
    success = getattr(function, "success", None)
    envs, settings, defaults, measures = (
        getattr(function, attribute, empty) for attribute, empty in (("envs", ()), ("settings", {}), ("defaults", {}), ("measures", {}))
    )
    ends_episode = getattr(function, "ends_episode", None)
    need(ends_episode is None or callable(ends_episode), f"{flag} {name}: {function_name}.ends_episode must be a function of a state")
    return Objective(name, function, success, tuple(envs), dict(settings), dict(defaults), dict(measures), ends_episode)


def run_objective(args) -> Objective | None:
    """The objective a run is taught (--teacher-objective) or trained on (--reward-objective), or None."""
    return load_objective(getattr(args, "teacher_objective", "") or getattr(args, "reward_objective", ""))


def episode_end(args) -> Callable[[Array], Array] | None:
    """The end of an episode the run's objective adds to the env's (Objective.ends_episode), or None."""
    objective = run_objective(args)
    return None if objective is None else objective.ends_episode


def env_name(env_id: str) -> str:
    """Hopper for Hopper-v5, Windmill for cleanrlhf_utils.example_envs.windmill:Windmill-v0."""
    from gymnasium.envs.registration import parse_env_id

    return parse_env_id(env_id.rpartition(":")[2])[1]


def objective_settings(args_class: type, name: str) -> dict:
    """What --teacher-objective NAME (or --reward-objective) sets unless the command line says otherwise: its needs
    (Objective.settings) and its defaults, for the fields args_class has. The defaults a command line is parsed onto
    take them (presets.settings_defaults); a command line that contradicts a need is refused by
    check_objective_settings."""
    objective = load_objective(name)
    if objective is None:
        return {}
    fields = {field.name for field in dataclasses.fields(args_class)}
    return {key: value for key, value in (objective.defaults | objective.settings).items() if key in fields}


def check_objective_settings(args, field: str = "teacher_objective") -> Objective | None:
    """The objective of Args `field` (--teacher-objective; --reward-objective for sac.py) against the run's settings,
    returned (None: no objective): one for another env, or a run without a setting it needs (the command line gave the
    opposite), is a ConfigError in one line. Changes nothing: the objective's needs are the run's defaults already."""
    flag = "--" + field.replace("_", "-")
    objective = load_objective(getattr(args, field, ""), flag)
    if objective is None:
        return None
    name = env_name(args.env_id)
    need(
        not objective.envs or name in objective.envs,
        f"{flag} {objective.name} is for {' / '.join(objective.envs)}, not --env-id {args.env_id}",
    )
    for setting, value in objective.settings.items():
        if hasattr(args, setting):
            need(getattr(args, setting) == value, f"{flag} {objective.name} needs {setting}={value}: drop --{setting.replace('_', '-')}")
    return objective


def check_objective(objective: Objective, obs_dim: int, action_dim: int, state_dim: int) -> None:
    """Call the objective once on zeros of the run's shapes: a function that fails or returns the wrong shape is
    refused before training starts, in one line."""
    shapes = (2, 3)
    probe = (np.zeros((*shapes, obs_dim)), np.zeros((*shapes, action_dim)), np.zeros((*shapes, state_dim)))
    try:
        rewards = np.asarray(objective.reward(*probe), dtype=np.float64)
    except Exception as error:  # noqa: BLE001 (the user's function: any failure is said in one line)
        raise ConfigError(
            f"--teacher-objective {objective.name} fails on (obs, actions, states) of shapes [n, L, {obs_dim}], [n, L, {action_dim}], "
            f"[n, L, {state_dim}] ({type(error).__name__}: {error})"
        ) from None
    need(
        rewards.shape == shapes,
        f"--teacher-objective {objective.name} must return per-step rewards of shape [n, L] = {list(shapes)}, got {list(rewards.shape)}",
    )


def segment_rewards(objective: Objective, segments: dict, obs_dim: int) -> Array:
    """The objective's per-step rewards of a feedback session's pairs (obs_actions, physics_states (N, 2, L, ...),
    masks (N, 2, L)): (N, 2, L), zero on masked steps. One vectorised call for the whole session."""
    obs_actions, states = segments["obs_actions"], segments["physics_states"]
    n, pair, length = obs_actions.shape[:3]
    flat = (n * pair, length)
    rewards = objective.reward(
        obs_actions[..., :obs_dim].reshape(*flat, obs_dim),
        obs_actions[..., obs_dim:].reshape(*flat, -1),
        states.reshape(*flat, states.shape[-1]),
    )
    return np.asarray(rewards, dtype=np.float64).reshape(n, pair, length) * segments["masks"]


def step_rewards(objective: Objective, obs: Array, actions: Array, states: Array) -> Array:
    """The objective's reward of N transitions [N] (obs, actions, states [N, ...]), each step taken alone as a
    one-step segment: what sac.py --reward-objective trains on, and what a run's reward model is measured against."""
    rewards = objective.reward(obs[:, None].astype(np.float64), actions[:, None].astype(np.float64), states[:, None])
    return np.asarray(rewards, dtype=np.float64)[:, 0]


class EpisodeMeasures(NamedTuple):
    """What an objective measured on one evaluation episode."""

    objective_return: float
    success: float | None
    """None when the objective has no success measure"""
    measures: dict[str, float]
    """the objective's further measures (Objective.measures), by name"""


def episode_measures(objective: Objective, obs: Array, actions: Array, states: Array) -> EpisodeMeasures:
    """One evaluation episode's objective return, success measure and further measures. obs and states hold T + 1
    rows (the final observation too), actions T."""
    actions = np.concatenate([actions, np.zeros((1, actions.shape[-1]))])[None]
    obs, states = obs[None], states[None]
    ret = float(np.asarray(objective.reward(obs, actions, states))[0, :-1].sum())
    success = None if objective.success is None else float(np.asarray(objective.success(obs, actions, states))[0])
    measures = {name: float(np.asarray(measure(obs, actions, states))[0]) for name, measure in objective.measures.items()}
    return EpisodeMeasures(ret, success, measures)


def mean_measures(episodes: list[EpisodeMeasures]) -> dict[str, float]:
    """The mean of each further measure over episodes."""
    return {name: float(np.mean([episode.measures[name] for episode in episodes])) for name in (episodes[0].measures if episodes else {})}
