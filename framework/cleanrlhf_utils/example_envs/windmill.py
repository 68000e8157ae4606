"""A windmill with no reward at all: a motor turns a four-bladed rotor, and every step's reward is 0.

What the rotor should do (turn clockwise, counter-clockwise, stand still, rock) is whatever the preferences say: the
synthetic teacher with `--teacher-objective windmill-clockwise` (or `windmill-counterclockwise`), or a person in
human mode. Use it with Gymnasium's "module:id" form, which imports this module (registering the id) first:

    python framework/sac_rlhf.py --env-id cleanrlhf_utils.example_envs.windmill:Windmill-v0 \\
        --teacher-objective windmill-clockwise --total-timesteps 20000

It is a Gymnasium MujocoEnv, so everything the scripts do with Gymnasium MuJoCo envs works here unchanged: the full
physics state is stored with every step (clips re-rendered for the page, exact resume), render_mode="rgb_array"
draws it (videos). The model is the XML string below; no file is needed beside this module.

Observation: [sin(angle), cos(angle), angular velocity] of the rotor. Action: the motor's torque in [-1, 1].
Clockwise is as the default camera sees it (from the front, -y, looking at the hub): a positive angular velocity.
"""

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium.envs.mujoco import MujocoEnv

WINDMILL_XML = """
<mujoco model="windmill">
  <option timestep="0.01"/>
  <visual><global offwidth="640" offheight="480"/></visual>
  <asset>
    <texture name="sky" type="skybox" builtin="gradient" rgb1="0.6 0.8 1" rgb2="0.2 0.3 0.5" width="64" height="64"/>
    <texture name="grid" type="2d" builtin="checker" rgb1="0.3 0.5 0.3" rgb2="0.25 0.45 0.25" width="64" height="64"/>
    <material name="grid" texture="grid" texrepeat="8 8"/>
  </asset>
  <worldbody>
    <light pos="0 -3 4" dir="0 1 -1"/>
    <geom name="ground" type="plane" size="4 4 0.1" material="grid"/>
    <geom name="tower" type="box" pos="0 0.15 0.75" size="0.08 0.08 0.75" rgba="0.8 0.8 0.75 1"/>
    <body name="rotor" pos="0 0 1.5">
      <joint name="hub" type="hinge" axis="0 1 0" damping="2"/>
      <geom name="hub" type="cylinder" size="0.1 0.05" euler="90 0 0" rgba="0.3 0.3 0.3 1"/>
      <geom name="blade_up" type="box" pos="0 0 0.5" size="0.07 0.02 0.45" rgba="0.9 0.2 0.2 1"/>
      <geom name="blade_right" type="box" pos="0.5 0 0" size="0.45 0.02 0.07" rgba="0.95 0.95 0.95 1"/>
      <geom name="blade_down" type="box" pos="0 0 -0.5" size="0.07 0.02 0.45" rgba="0.95 0.95 0.95 1"/>
      <geom name="blade_left" type="box" pos="-0.5 0 0" size="0.45 0.02 0.07" rgba="0.95 0.95 0.95 1"/>
    </body>
  </worldbody>
  <actuator>
    <motor name="motor" joint="hub" gear="20" ctrlrange="-1 1" ctrllimited="true"/>
  </actuator>
</mujoco>
"""

ANGULAR_VELOCITY = 2
"""index of the rotor's angular velocity (rad/s, clockwise positive) in the observation"""


class WindmillEnv(MujocoEnv):
    """A motor-driven rotor whose reward is always 0 (see the module's docstring)."""

    metadata = {"render_modes": ["human", "rgb_array", "depth_array", "rgbd_tuple"], "render_fps": 25}

    def __init__(self, frame_skip: int = 4, **kwargs):
        space = gym.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float64)
        camera = {"distance": 4.0, "azimuth": 90.0, "elevation": 0.0, "lookat": np.array([0.0, 0.0, 1.2])}
        # model_path must name a file that exists; the model itself comes from WINDMILL_XML (_initialize_simulation)
        MujocoEnv.__init__(self, __file__, frame_skip, space, default_camera_config=camera, **kwargs)

    def _initialize_simulation(self):
        model = mujoco.MjModel.from_xml_string(WINDMILL_XML)
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, self.width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, self.height)
        return model, mujoco.MjData(model)

    def _get_obs(self) -> np.ndarray:
        angle, velocity = self.data.qpos[0], self.data.qvel[0]
        return np.array([np.sin(angle), np.cos(angle), velocity], dtype=np.float64)

    def step(self, action):
        self.do_simulation(action, self.frame_skip)
        if self.render_mode == "human":
            self.render()
        return self._get_obs(), 0.0, False, False, {"angle": float(self.data.qpos[0])}

    def reset_model(self) -> np.ndarray:
        qpos = self.init_qpos + self.np_random.uniform(-np.pi, np.pi, size=self.model.nq)
        qvel = self.init_qvel + self.np_random.uniform(-0.1, 0.1, size=self.model.nv)
        self.set_state(qpos, qvel)
        return self._get_obs()


if "Windmill-v0" not in gym.registry:
    gym.register("Windmill-v0", entry_point=WindmillEnv, max_episode_steps=200)
