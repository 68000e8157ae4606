"""Ant-v5 as Gymnasium builds it, less the 78 contact forces in its 105-number observation (Ant-v4's default, the
27 numbers of the body's pose and velocities): an experiment on the reward model's inputs, where the contact
forces outnumber the rest three to one and the learned reward misses the control cost that dominates the Ant's
true reward. Both runs see the same observation. The module registers the id when imported (Gymnasium's
"module:id" form); the benchmarks start their runs with bench/ on the import path:

    python bench/feedback_efficiency.py --variant norm-reset-std1 --labels 500 --seeds 1 \\
        --env-id ant_without_contact_forces:AntWithoutContactForces-v5 --no-terminate-when-unhealthy

`walking` is a teacher's objective for either Ant: what a person sees of its task. docs/benchmarks/findings/gym-mujoco.md
has what both did."""

import gymnasium as gym
import numpy as np

from cleanrlhf_utils.objectives import ANT_NQ, qpos, qvel

ENV_ID = "AntWithoutContactForces-v5"
ANT_NV = 14
"""Ant-v5's velocities: the torso's 6 and the 8 joints'"""
HEALTHY_Z = (0.2, 1.0)
"""Ant-v5's healthy torso heights (metres)"""

if ENV_ID not in gym.registry:
    gym.register(
        ENV_ID,
        entry_point="gymnasium.envs.mujoco.ant_v5:AntEnv",
        max_episode_steps=1000,
        kwargs={"include_cfrc_ext_in_observation": False},
    )


def walking(obs: np.ndarray, actions: np.ndarray, states: np.ndarray) -> np.ndarray:
    """What a person watching a clip of the Ant sees of its task, as a teacher's objective (`--teacher-objective
    ant_without_contact_forces:walking`): the torso's forward speed (m/s) plus Ant-v5's healthy reward (1 a step with
    the torso between 0.2 and 1 m high), without the control and contact costs no clip shows. The Ant's own labels
    differ in torque far more than in forward progress (docs/benchmarks/findings/gym-mujoco.md), and Christiano et al.
    (2017) judged their Ant by progress and staying up. Any Ant-v5 (the physics state is the same with or without the
    contact forces in the observation)."""
    low, high = HEALTHY_Z
    height, forward = qpos(states, ANT_NQ)[..., 2], qvel(states, ANT_NQ, ANT_NV)[..., 0]
    return forward + ((height >= low) & (height <= high))


walking.envs = ("Ant", "AntWithoutContactForces")
