"""Environments: Gymnasium MuJoCo, the DeepMind Control Suite (through shimmy), Meta-World and classic control.

Besides building envs, this module reads and writes the simulator state behind every observation, so that a
stored segment can be re-rendered for a person long after it was lived, and a checkpointed run can continue
mid-episode bit for bit."""

import functools
import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np

from .errors import ConfigError, need


def registered_id(env_id: str) -> str:
    """The registry id of `env_id`. Gymnasium's "module:id" form (`my_package.my_module:MyEnv-v0`) names a module
    to import first, which registers the id; gym.make does the same import, so the full form is what runs keep."""
    if ":" not in env_id:
        return env_id
    module, _, name = env_id.partition(":")
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 (any failure to import is the user's module, said in one line)
        raise ConfigError(f"--env-id {env_id}: module {module} does not import ({type(error).__name__}: {error})") from None
    return name


def placeholder(spec) -> bool:
    """Whether a registered id is only Gymnasium's pointer elsewhere (the MuJoCo v2 and v3 envs, moved to
    gymnasium-robotics): its entry point raises instead of building an env."""
    return callable(spec.entry_point) and getattr(spec.entry_point, "__name__", "").startswith("_raise")


LIST_ENVS = "python framework/list_envs.py --only <name>"
"""the command that tries environments on this machine, named where an --env-id does not run"""


def check_env_id(env_id: str) -> None:
    """One line for an id this machine cannot run: unregistered (with the close ids that do run), or registered only
    as a pointer elsewhere (with its reason)."""
    name = registered_id(env_id)
    if ":" in env_id:
        need(name in gym.registry, f"--env-id {env_id}: importing {env_id.partition(':')[0]} registered no environment {name}")
        return
    if env_id.startswith("dm_control/") or env_id not in gym.registry:  # shimmy registers dm_control/<domain>-<task>-v0
        import shimmy

        gym.register_envs(shimmy)
    if env_id.startswith(METAWORLD_PREFIX) or env_id not in gym.registry:
        register_metaworld()
    runnable = [registered for registered, spec in gym.registry.items() if not placeholder(spec)]
    if env_id in gym.registry and not placeholder(gym.registry[env_id]):
        return
    import difflib

    close = difflib.get_close_matches(env_id, runnable, n=5, cutoff=0.6)
    hint = f" (similar ids that run here: {', '.join(close)})" if close else ""
    hint += f"; {LIST_ENVS} checks which ids run here (docs/reference/working-envs.md lists them)"
    if env_id not in gym.registry:
        raise ConfigError(f"--env-id {env_id} is not a registered Gymnasium environment{hint}")
    try:
        gym.registry[env_id].entry_point()
        reason = "it cannot be built here"
    except Exception as error:  # noqa: BLE001 (Gymnasium's pointer says where the env went)
        reason = (str(error).splitlines() or [type(error).__name__])[0]
    raise ConfigError(f"--env-id {env_id} does not run here: {reason}{hint}")


def accepts_keyword(env_id: str, keyword: str) -> bool:
    """Whether the env's constructor takes `keyword` (terminate_when_unhealthy: Gymnasium's Hopper, Walker2d, Ant,
    Humanoid; healthy_angle_range: Hopper, Walker2d)."""
    import inspect

    entry_point = gym.spec(registered_id(env_id)).entry_point
    creator = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    try:
        return keyword in inspect.signature(creator).parameters
    except (TypeError, ValueError):
        return False


def refuse_unless_accepted(env_id: str, keyword: str, flag: str, what: str) -> None:
    """ConfigError in one line, naming the envs that do take `keyword`, unless env_id's constructor takes it."""
    if accepts_keyword(env_id, keyword):
        return
    having = [name for name in gym.registry if name.endswith("-v5") and accepts_keyword(name, keyword)]
    raise ConfigError(f"{flag}: {env_id} has no {what} to turn off (envs that have it: {', '.join(having)})")


def env_kwargs(env_id: str, terminate_when_unhealthy: bool = True, terminate_when_tilted: bool = True) -> dict:
    """Keyword arguments for gym.make beyond rendering; a request the env cannot honour is an error, never ignored.
    terminate_when_tilted=False with unhealthy termination on ends episodes on a fall (torso height) only: the angle
    Gymnasium calls unhealthy (Hopper 0.2 rad, Walker2d 1 rad) is widened to any angle."""
    if not terminate_when_tilted:
        refuse_unless_accepted(env_id, "healthy_angle_range", "--no-terminate-when-tilted", "termination on the torso's angle")
    if not terminate_when_unhealthy:
        refuse_unless_accepted(env_id, "terminate_when_unhealthy", "--no-terminate-when-unhealthy", "unhealthy termination")
        return {"terminate_when_unhealthy": False}
    return {} if terminate_when_tilted else {"healthy_angle_range": (-math.inf, math.inf)}


def image_observation_keys(space: gym.Space) -> list[str]:
    """Keys of a Dict observation that hold camera images: these scripts learn from state vectors."""
    if not isinstance(space, gym.spaces.Dict):
        return []
    return [key for key, sub in space.spaces.items() if isinstance(sub, gym.spaces.Box) and sub.dtype == np.uint8 and len(sub.shape) >= 2]


def is_mujoco_env(env_id: str) -> bool:
    """dm_control, Meta-World, Gymnasium's MuJoCo envs and any env of your own that subclasses Gymnasium's MujocoEnv."""
    if env_id.startswith(("dm_control/", METAWORLD_PREFIX)):
        return True
    entry_point = gym.spec(registered_id(env_id)).entry_point
    if "mujoco" in str(entry_point):
        return True
    try:
        creator = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
        from gymnasium.envs.mujoco import MujocoEnv

        return isinstance(creator, type) and issubclass(creator, MujocoEnv)
    except Exception:  # noqa: BLE001 (an entry point that does not load is no MuJoCo env)
        return False


def check_can_render(env_id: str, feature: str) -> None:
    """Classic-control environments draw with pygame, an optional dependency of Gymnasium."""
    if is_mujoco_env(env_id):
        return
    need(
        importlib.util.find_spec("pygame") is not None,
        f"{feature} renders --env-id {env_id} with pygame, which is not installed (pip install 'gymnasium[classic-control]')",
    )


def check_render_mode(env_id: str, render_mode: str | None) -> None:
    """--render-mode human draws the training environment in a window, through GLFW: a Gymnasium MuJoCo env (dm_control
    and Meta-World draw offscreen only), a display to open the window on, and MUJOCO_GL left to GLFW."""
    if render_mode is None:
        return
    windowed = is_mujoco_env(env_id) and not env_id.startswith(("dm_control/", METAWORLD_PREFIX))
    need(windowed, f"--render-mode human draws Gymnasium MuJoCo envs only, not --env-id {env_id}; use --capture-video")
    display = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    need(display, "--render-mode human opens a window, and there is no display: run under xvfb-run, or use --capture-video")
    backend = os.environ.get("MUJOCO_GL", "glfw")
    need(backend == "glfw", f"--render-mode human draws through GLFW, and MUJOCO_GL is {backend}: unset MUJOCO_GL")


def make_env(
    env_id: str,
    seed: int,
    render_mode: str | None = None,
    width: int = 320,
    height: int = 240,
    terminate_when_unhealthy: bool = True,
    check_actions: Callable[[str, gym.Space], None] | None = None,
    task_seed: int | None = None,
    terminate_when_tilted: bool = True,
    camera: str = "env",
    ends_episode: Callable[[np.ndarray], bool] | None = None,
):
    """A thunk building one env: Dict observations flattened (keys in a fixed order), camera-image observations
    refused, shadows cheapened for software rendering. `check_actions(env_id, action_space)` is the algorithm's
    own requirement on the action space (it raises ConfigError). `task_seed` picks a Meta-World task's layout
    (default: `seed`); other envs ignore it. `camera`: what rgb_array frames show (CAMERAS). `ends_episode(state)`:
    an objective's own end of an episode (Objective.ends_episode), tested on the simulator state after each step."""
    need(camera in CAMERAS, f"--camera {camera} is not one of: {', '.join(CAMERAS)}")

    def thunk():
        check_env_id(env_id)
        kwargs = env_kwargs(env_id, terminate_when_unhealthy, terminate_when_tilted)
        if env_id.startswith(METAWORLD_PREFIX):
            kwargs |= {"task_seed": seed if task_seed is None else task_seed}
        if render_mode == "rgb_array" and env_id.startswith("dm_control/"):
            kwargs |= {"render_kwargs": {"width": width, "height": height, "camera_id": 0}}
        elif render_mode == "rgb_array" and is_mujoco_env(env_id):  # classic control draws at its own size
            kwargs |= {"width": width, "height": height}
        env = gym.make(env_id, render_mode=render_mode, **kwargs)
        images = image_observation_keys(env.observation_space)
        if images:
            env.close()
            raise ConfigError(f"--env-id {env_id} observes camera images ({', '.join(images)}); these scripts need state observations")
        if isinstance(env.observation_space, gym.spaces.Dict):
            env = gym.wrappers.FlattenObservation(env)
        if check_actions is not None:
            try:
                check_actions(env_id, env.action_space)
            except ConfigError:
                env.close()
                raise
        lower_shadow_quality(env)
        if camera in ("side", "track"):
            use_side_camera(env, env_id, camera)
        if camera == "track":
            env = FollowingCamera(env)
        if ends_episode is not None:
            env = EndsOnState(env, ends_episode)
        env.action_space.seed(seed)
        return env

    return thunk


class EndsOnState(gym.Wrapper):
    """Ends an episode (terminated, as a fall does) when `ends_episode` holds for the simulator state a step reached:
    an objective's own failure, e.g. a Hopper part other than its foot touching the floor."""

    def __init__(self, env: gym.Env, ends_episode: Callable[[np.ndarray], bool]):
        super().__init__(env)
        self.ends_episode = ends_episode

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated or bool(self.ends_episode(get_physics_state(self.env))), truncated, info


# ----------------------------------------------------------------------------------------
# Meta-World: metaworld/<task> (metaworld/door-open-v3, ...), one fixed layout per seed
# ----------------------------------------------------------------------------------------
METAWORLD_PREFIX = "metaworld/"
METAWORLD_CAMERA = "corner3"
"""the view of clips and videos: the whole arm, the object and the goal, for every task (the papers' corner view)"""


def register_metaworld() -> None:
    """metaworld/<task> for each of Meta-World's 50 v3 tasks, built by make_metaworld_env."""
    if any(name.startswith(METAWORLD_PREFIX) for name in gym.registry):
        return
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    for task in ALL_V3_ENVIRONMENTS:
        # 500 steps: Meta-World's own horizon (max_path_length), the papers' episode length; the env raises past it.
        gym.register(f"{METAWORLD_PREFIX}{task}", "cleanrlhf_utils.envs:make_metaworld_env", max_episode_steps=500, kwargs={"task": task})


def metaworld_env_ids() -> list[str]:
    register_metaworld()
    return sorted(name for name in gym.registry if name.startswith(METAWORLD_PREFIX))


class MetaWorldEnv(gym.Wrapper):
    """A Meta-World task with the Gymnasium behaviour the scripts rely on: reset(seed=...) seeds it (Meta-World
    ignores that seed and has its own seed()), and frames come the right way up."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.env.unwrapped.seed(seed)
        return self.env.reset()

    def render(self):
        # Meta-World's corner cameras are mounted upside down: a 180-degree turn (not a mirror) puts the table below.
        return np.ascontiguousarray(self.env.render()[::-1, ::-1])


@functools.cache
def metaworld_task(task: str, task_seed: int):
    """Task 0 of Meta-World's MT1 benchmark for this seed (drawing MT1 builds envs and takes most of a second;
    evaluations and renderers of a run reuse it)."""
    import metaworld

    return metaworld.MT1(task, seed=task_seed).train_tasks[0]


def make_metaworld_env(task: str, task_seed: int = 0, render_mode: str | None = None, width: int = 320, height: int = 240) -> gym.Env:
    """Meta-World's single-task setting as in B-Pref and PEBBLE: the goal is part of the observation and one layout
    (object and goal positions) is fixed for the whole run. The layout is task 0 of Meta-World's MT1 benchmark drawn
    with `task_seed`: each seed is another layout, and every env built with the same seed (training, evaluation)
    has the same one."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    env = ALL_V3_ENVIRONMENTS[task](render_mode=render_mode, camera_name=METAWORLD_CAMERA, width=width, height=height)
    env.set_task(metaworld_task(task, task_seed))  # goal-observable, layout frozen across resets
    env.seed(task_seed)
    # Built while the env was still goal-hidden, observation_space bounds the goal to [0, 0, 0]; this one is the real one.
    env.observation_space = env.sawyer_observation_space
    return MetaWorldEnv(env)


def is_metaworld(env: gym.Env) -> bool:
    return hasattr(env.unwrapped, "_last_rand_vec")


# Meta-World moves the hand through a mocap body, which MuJoCo's full physics state leaves out.
METAWORLD_PHYSICS = ("mjSTATE_FULLPHYSICS", "mjSTATE_MOCAP_POS", "mjSTATE_MOCAP_QUAT")


def metaworld_state_spec() -> int:
    import mujoco

    spec = 0
    for name in METAWORLD_PHYSICS:
        spec |= int(getattr(mujoco.mjtState, name))
    return spec


def get_metaworld_state(env: gym.Env) -> np.ndarray:
    """MuJoCo's state with the mocap body, then what the next observation also depends on: the previous frame
    (observations stack two), the step count (the env truncates at 500) and the layout (`_last_rand_vec`: where
    the object and goal are, so that a state re-renders in an env of any seed)."""
    import mujoco

    unwrapped, spec = env.unwrapped, metaworld_state_spec()
    physics = np.empty(mujoco.mj_stateSize(unwrapped.model, spec), dtype=np.float64)
    mujoco.mj_getState(unwrapped.model, unwrapped.data, physics, spec)
    extra = [unwrapped._prev_obs, [unwrapped.curr_path_length], unwrapped._last_rand_vec]
    return np.concatenate([physics, *(np.asarray(part, dtype=np.float64) for part in extra)])


def set_metaworld_state(env: gym.Env, state: np.ndarray) -> None:
    import mujoco

    unwrapped, spec = env.unwrapped, metaworld_state_spec()
    size, prev = mujoco.mj_stateSize(unwrapped.model, spec), len(unwrapped._prev_obs)
    layout = state[size + prev + 1 :]
    if not np.array_equal(layout, unwrapped._last_rand_vec):  # the layout moves model fields (door, goal site): reset into it
        unwrapped._last_rand_vec = layout.copy()
        unwrapped.reset()
    mujoco.mj_setState(unwrapped.model, unwrapped.data, state[:size], spec)
    mujoco.mj_forward(unwrapped.model, unwrapped.data)
    unwrapped._prev_obs = state[size : size + prev].copy()
    unwrapped.curr_path_length = int(state[size + prev])


def reached_success(infos) -> bool | None:
    """Whether an episode, given as its steps' info dicts, reached success at any step (Meta-World's success can
    switch off again: an episode that opened the door counts); None when the env reports no `success`."""
    flags = [info["success"] for info in infos if "success" in info]
    return bool(np.any(np.asarray(flags, dtype=np.float64) > 0)) if flags else None


CAMERAS = {
    "env": "the env's own view (Gymnasium's Hopper: a camera that stays where the Hopper starts, looking down at 20 degrees)",
    "side": "a camera fixed beside the robot's starting place, 3.5 times the root body's height away, looking down 5 "
    "degrees at 0.9 times that height: the floor, heights and turns read at a glance (Gymnasium MuJoCo envs)",
    "track": "the side camera moved along with the robot's centre of mass: a runner stays in the frame, the floor "
    "passing by shows its speed (Gymnasium MuJoCo envs)",
}
"""the views of rendered frames (evaluation videos, filmstrips), by --camera name"""


def use_side_camera(env: gym.Env, env_id: str, camera: str = "side") -> None:
    """Render `env` (just made, no frame rendered yet) from CAMERAS["side"]: a free MuJoCo camera aimed along +y at
    the root body's reference position (+x to the right). It stays put, so a flip's height above the floor and its
    turn show as they are. (`camera`: the name the error gives, "track" where FollowingCamera moves it.)"""
    import mujoco

    model, _ = raw_mujoco(env)
    renderer = getattr(env.unwrapped, "mujoco_renderer", None)
    need(
        model is not None and renderer is not None and not hasattr(env.unwrapped, "physics"),
        f"--camera {camera}: --env-id {env_id} is not a Gymnasium MuJoCo env (it renders from its own cameras only)",
    )
    x, y, z = (float(value) for value in model.body_pos[1])  # the root body, where the model places it
    height = max(z, 0.5)
    renderer.camera_id = -1  # the free camera, configured by default_cam_config when the first frame is rendered
    renderer.default_cam_config = {
        "type": int(mujoco.mjtCamera.mjCAMERA_FREE),
        "lookat": np.array([x, y, 0.9 * height]),
        "distance": 3.5 * height,
        "azimuth": 90.0,
        "elevation": -5.0,
    }


class FollowingCamera(gym.Wrapper):
    """CAMERAS["track"]: the side camera moved along x to the robot's centre of mass before each frame. Set from the
    state alone (MuJoCo's own tracking camera lags behind, so a frame would depend on the frames rendered before it)."""

    def render(self):
        _, data = raw_mujoco(self.env)
        renderer = self.env.unwrapped.mujoco_renderer
        x = float(data.subtree_com[1, 0])  # the root body's subtree: the whole robot
        renderer.default_cam_config["lookat"][0] = x  # the camera of the first frame, made when it is rendered
        if renderer.viewer is not None:
            renderer.viewer.cam.lookat[0] = x
        return self.env.render()


def lower_shadow_quality(env: gym.Env) -> None:
    # Offscreen software rendering (llvmpipe) spends most of its time on the shadow map.
    model, _ = raw_mujoco(env)
    if model is not None:
        model.vis.quality.shadowsize = 1024


def raw_mujoco(env: gym.Env):
    """The mujoco.MjModel and MjData behind a Gymnasium MuJoCo or dm_control env, or (None, None)."""
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):  # dm_control through shimmy
        return unwrapped.physics.model._model, unwrapped.physics.data._data
    if hasattr(unwrapped, "model") and hasattr(unwrapped, "data"):
        return unwrapped.model, unwrapped.data
    return None, None


def get_physics_state(env: gym.Env) -> np.ndarray:
    """The simulator state behind the current observation, enough to re-render it exactly: dm_control's physics
    state, MuJoCo's full physics state (Meta-World's with its mocap hand, previous frame and layout), or a
    classic-control env's `state` (CartPole, Pendulum, ...)."""
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "physics"):
        return unwrapped.physics.get_state().copy()
    if is_metaworld(env):
        return get_metaworld_state(env)
    model, data = raw_mujoco(env)
    if model is not None:
        import mujoco

        state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_FULLPHYSICS), dtype=np.float64)
        mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
        return state
    if getattr(unwrapped, "state", None) is not None:  # classic control keeps its whole state in `state`
        return np.array(unwrapped.state, dtype=np.float64).ravel()
    # Any other Gymnasium env: nothing to store (width 0). It still trains with the synthetic teacher and a label file;
    # human mode refuses it (connect_human_teacher: clips are re-rendered from states), and a checkpoint cannot restore it.
    return np.zeros(0, dtype=np.float64)


def set_physics_state(env: gym.Env, state: np.ndarray) -> None:
    unwrapped = env.unwrapped
    if np.asarray(state).size == 0:
        name = unwrapped.spec.id if unwrapped.spec is not None else type(unwrapped).__name__
        raise ConfigError(f"--env-id {name} exposes no simulator state (MuJoCo, dm_control or a classic-control `state`) to restore")
    if hasattr(unwrapped, "physics"):
        with unwrapped.physics.reset_context():
            unwrapped.physics.set_state(state)
        return
    if is_metaworld(env):
        set_metaworld_state(env, state)
        return
    model, data = raw_mujoco(env)
    if model is not None:
        import mujoco

        mujoco.mj_setState(model, data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
        mujoco.mj_forward(model, data)
        return
    unwrapped.state = np.array(state, dtype=np.float64)
    if hasattr(unwrapped, "steps_beyond_terminated"):  # CartPole: a stored state is never past its episode's end
        unwrapped.steps_beyond_terminated = None


def physics_state_size(env: gym.Env) -> int:
    return get_physics_state(env).shape[0]


# ----------------------------------------------------------------------------------------
# Exact resume: what the next step depends on beyond the observation
# ----------------------------------------------------------------------------------------
def mujoco_integration_state(env: gym.Env) -> np.ndarray | None:
    """The full physics state plus what the next step depends on beyond it (the constraint solver's warm
    start, controls), so that a resumed run continues bit for bit."""
    import mujoco

    model, data = raw_mujoco(env)
    if model is None:
        return None
    state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_INTEGRATION), dtype=np.float64)
    mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    return state


def set_mujoco_integration_state(env: gym.Env, state: np.ndarray) -> None:
    import mujoco

    model, data = raw_mujoco(env)
    mujoco.mj_setState(model, data, state, mujoco.mjtState.mjSTATE_INTEGRATION)


def rng_state(env: gym.Env):
    # dm_control tasks draw from a legacy np.random.RandomState, Gymnasium envs from a Generator.
    generator = env.unwrapped.np_random
    return generator.get_state() if isinstance(generator, np.random.RandomState) else generator.bit_generator.state


def set_rng_state(env: gym.Env, state) -> None:
    generator = env.unwrapped.np_random
    if isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.bit_generator.state = state


def episode_counters(env: gym.Env) -> dict:
    # dm_control keeps its own time limit: the suite counts steps inside its Environment, not in a TimeLimit wrapper.
    inner = getattr(env.unwrapped, "_env", None)
    return {key: getattr(inner, key) for key in ("_step_count", "_reset_next_step") if hasattr(inner, key)}


def set_episode_counters(env: gym.Env, counters: dict) -> None:
    for key, value in counters.items():
        setattr(env.unwrapped._env, key, value)


def time_limit_wrapper(env: gym.Env):
    while not isinstance(env, gym.wrappers.TimeLimit) and hasattr(env, "env"):
        env = env.env
    return env


def capture_env_state(envs: gym.vector.SyncVectorEnv, obs: np.ndarray) -> dict:
    """Everything needed to continue the training environments mid-episode after a resume."""
    sub_envs = [
        {
            "physics": get_physics_state(env),
            "integration": mujoco_integration_state(env),
            "elapsed_steps": getattr(time_limit_wrapper(env), "_elapsed_steps", None),
            "np_random": rng_state(env),
            "episode_counters": episode_counters(env),
            "steps_beyond_terminated": getattr(env.unwrapped, "steps_beyond_terminated", None),  # classic control
        }
        for env in envs.envs
    ]
    return {"envs": sub_envs, "autoreset": autoreset_pending(envs).copy(), "obs": obs.copy()}


def autoreset_pending(envs: gym.vector.SyncVectorEnv) -> np.ndarray:
    """Which sub-envs' next step only resets them (next-step autoreset after an episode ended): such a step is no
    transition to store. Gymnasium keeps these flags in a private attribute and offers no public reader; this function,
    capture_env_state and restore_env_state are the only places that touch it (tests/test_environments.py checks it)."""
    return envs._autoreset_envs


def restore_env_state(envs: gym.vector.SyncVectorEnv, state: dict) -> np.ndarray:
    for env, saved in zip(envs.envs, state["envs"]):
        set_physics_state(env, saved["physics"])
        if saved["integration"] is not None:
            set_mujoco_integration_state(env, saved["integration"])
        if saved["elapsed_steps"] is not None:
            time_limit_wrapper(env)._elapsed_steps = saved["elapsed_steps"]
        set_rng_state(env, saved["np_random"])
        set_episode_counters(env, saved["episode_counters"])
        if hasattr(env.unwrapped, "steps_beyond_terminated"):
            env.unwrapped.steps_beyond_terminated = saved["steps_beyond_terminated"]
    autoreset_pending(envs)[:] = state["autoreset"]
    return state["obs"].copy()


# ----------------------------------------------------------------------------------------
# Rendering stored states: clips for people, evaluation videos
# ----------------------------------------------------------------------------------------
class SegmentRenderer:
    """Re-renders stored simulator states with one reused offscreen renderer.

    Every GL call runs on one dedicated thread: dm_control's EGL context is bound to the thread that first
    renders with it, while clips are rendered from a background thread that differs between sessions."""

    def __init__(self, env_id: str, width: int = 320, height: int = 240, shadows: bool = True, camera: str = "env"):
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment-renderer")
        self.executor.submit(self._open, env_id, width, height, shadows, camera).result()

    def _open(self, env_id: str, width: int, height: int, shadows: bool, camera: str) -> None:
        self.env = make_env(env_id, seed=0, render_mode="rgb_array", width=width, height=height, camera=camera)()
        self.env.reset(seed=0)
        self.fps = self.env.metadata.get("render_fps", 30)
        self.physics = getattr(self.env.unwrapped, "physics", None)
        scene = None
        if self.physics is not None:  # dm_control: a plain MuJoCo renderer on the task's first camera
            import mujoco

            self.mj_renderer = mujoco.Renderer(self.physics.model._model, height, width)
            scene = self.mj_renderer.scene
        elif raw_mujoco(self.env)[0] is not None:  # Gymnasium MuJoCo: the env's own renderer, which knows its tracking camera
            scene = self.env.unwrapped.mujoco_renderer._get_viewer("rgb_array").scn
        if scene is not None and not shadows:
            import mujoco

            # Shadows and reflections are most of llvmpipe's work: without them clips render about 3x faster.
            scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._render(get_physics_state(self.env)[None])  # create the GL context now, not when the first clip is due

    def _render(self, states: np.ndarray) -> np.ndarray:
        frames = []
        for state in states:
            set_physics_state(self.env, state)
            if self.physics is not None:
                self.mj_renderer.update_scene(self.physics.data._data, camera=0)
                frames.append(self.mj_renderer.render())
            else:
                frames.append(self.env.render())
        return np.stack(frames)

    def render_states(self, states: np.ndarray) -> np.ndarray:
        return self.executor.submit(self._render, states).result()

    def close(self) -> None:
        try:
            if self.physics is not None:
                self.executor.submit(self.mj_renderer.close).result()
            self.executor.submit(self.env.close).result()
        finally:
            self.executor.shutdown()


def segment_frames(renderer: SegmentRenderer, states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Frames of a segment; after its episode ended the last frame is held, so both clips last as long."""
    valid = int(mask.sum())
    frames = renderer.render_states(states[:valid])
    return np.concatenate([frames, np.repeat(frames[-1:], len(states) - valid, axis=0)])


def write_mp4(path: str | Path, frames: np.ndarray, fps: float) -> None:
    """Writes H.264 mp4 with imageio-ffmpeg's own ffmpeg (TensorBoard's add_video is broken with moviepy 2)."""
    import imageio_ffmpeg

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    height, width = frames.shape[1:3]
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (width, height),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        quality=7,
        output_params=["-preset", "veryfast"],
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def write_gif(path: str | Path, frames: np.ndarray, frame_ms: float, size: tuple[int, int] | None = None, colors: int = 256) -> None:
    """A looping GIF of frames [T, H, W, 3], each shown `frame_ms` milliseconds, optionally scaled to `size` (width,
    height), in one palette of `colors` colours for all frames: what stays put between frames stays the same pixels, so
    the file stores only what moved (a third to a half of per-frame palettes' size). No dithering, no random numbers:
    the same frames give the same bytes."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    if size is not None:
        images = [image.resize(size, Image.Resampling.LANCZOS) for image in images]
    every_frame = Image.fromarray(np.concatenate([np.asarray(image) for image in images]))  # the palette's colours
    palette = every_frame.quantize(colors, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    images = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(frame_ms), loop=0, optimize=True)
