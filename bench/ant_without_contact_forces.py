"""The benchmarks' name for Ant-v5 less its 78 contact-force inputs (cleanrlhf_utils/example_envs/
ant_without_contact_forces.py registers it; importing this module does), and `walking`, a teacher's objective for
either Ant: what a person sees of its task. The benchmarks start their runs with bench/ on the import path, so the
"module:id" form is short there:

    python bench/feedback_efficiency.py --variant norm-reset-std1 --labels 500 --seeds 1 \\
        --env-id ant_without_contact_forces:AntWithoutContactForces-v5 --no-terminate-when-unhealthy

docs/benchmarks/findings/gym-mujoco.md has what both did."""

import numpy as np

from cleanrlhf_utils.example_envs.ant_without_contact_forces import ENV_ID
from cleanrlhf_utils.objectives import ANT_NQ, qpos, qvel

__all__ = ["ENV_ID", "walking"]  # the id, registered on import, for the benchmarks to read here

ANT_NV = 14
"""Ant-v5's velocities: the torso's 6 and the 8 joints'"""
HEALTHY_Z = (0.2, 1.0)
"""Ant-v5's healthy torso heights (metres)"""


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
